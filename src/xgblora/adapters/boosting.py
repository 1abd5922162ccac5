"""XGBLoRA: when to merge the booster (fixed, or the fork's adaptive merge with a cap), which layers carry it, where
a new booster starts (random, or from the gradient), shrinkage, and the booster history."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from xgblora.adapters.lora import LoRALinear, check_adapted
from xgblora.errors import UserError
from xgblora.models.quant import is_quantized

log = logging.getLogger("xgblora")

_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_of(name: str) -> str:
    """The transformer block a module belongs to: its name up to the first numeric part ('...layers.3'), else itself."""
    match = _BLOCK.match(name)
    return match.group(1) if match else name


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32, copy=True)


class Boosting:
    """Gradient boosting of low-rank adapters: train a booster, merge it into the base weights, start a fresh one."""

    def __init__(self, modules: dict[str, LoRALinear], *, steps_per_iteration: int | None = None,
                 layers_per_booster: int | None = None, layer_share: float = 1.0, shrinkage: float = 1.0,
                 adaptive: bool = False, max_booster_steps: int | None = None, patience: int = 50,
                 threshold: float = 1e-3, ema: float = 0.9, seed: int = 0):
        if not modules:
            raise UserError("XGBLoRA needs at least one adapted module")
        self.modules = dict(modules)
        self.blocks: dict[str, list[str]] = {}
        for name in self.modules:
            self.blocks.setdefault(block_of(name), []).append(name)
        self._block_names = list(self.blocks)
        count = len(self._block_names)
        share = max(1, round(layer_share * count))  # the paper's L_s: about a third of the layers
        self.layers_per_booster = min(share if layers_per_booster is None else layers_per_booster, count)
        self.steps_per_iteration = steps_per_iteration
        self.max_booster_steps = max_booster_steps  # the adaptive merge's cap (default: steps_per_iteration)
        self.shrinkage, self.adaptive = float(shrinkage), adaptive
        self.patience, self.threshold, self.ema = patience, float(threshold), float(ema)
        self.history: list[dict[str, Any]] = []
        self.subset: list[int] = list(range(count))
        self._generator = torch.Generator().manual_seed(seed)
        self._ema: float | None = None
        self._best: float | None = None
        self._since_best = 0
        self._snapshot: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    # ------------------------------------------------------------------ layer subsets

    def active_modules(self) -> dict[str, LoRALinear]:
        """The modules that carry the current booster."""
        return {name: m for name, m in self.modules.items() if m.active}

    def begin(self) -> None:
        """Choose the first iteration's layer subset; the first booster keeps attach()'s initialisation."""
        self._choose_subset()
        self._start_tracking()

    def _choose_subset(self) -> None:
        count = len(self._block_names)
        if self.layers_per_booster >= count:
            self._apply_subset(list(range(count)))
        else:
            picked = torch.randperm(count, generator=self._generator)[: self.layers_per_booster]
            self._apply_subset(sorted(picked.tolist()))

    def _apply_subset(self, subset: list[int]) -> None:
        self.subset = list(subset)
        chosen = {name for i in self.subset for name in self.blocks[self._block_names[i]]}
        for name, m in self.modules.items():
            m.active = name in chosen
            m.lora_A.requires_grad_(m.active)
            m.lora_B.requires_grad_(m.active)

    def absorb(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Merge a trained adapter ({module: (A, B, scaling)}) into the base weights as booster 1 at step 0: its
        record in the history keeps exports (base + every booster) exact."""
        check_adapted(factors, self.modules)
        record = {}
        for name, (A, B, scale) in factors.items():
            self.modules[name].merge_factors(A, B, scale)
            record[name] = {"A": _cpu_copy(A), "B": _cpu_copy(B), "scale": float(scale)}
        self.history.append({"booster": len(self.history) + 1, "step": 0, "modules": record})
        log.info("XGBLoRA: the adapter's %d modules merged as booster %d", len(record), len(self.history))

    def init_from_gradients(self, backward: Callable[[list[torch.nn.Parameter]], None],
                            reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                            orthogonal: bool = False) -> None:
        """Start the current booster where the gradient points (--xgblora_init gradient): backward(inputs) runs the
        loss's backward over a few batches (into inputs, the active lora_B, only), every active layer accumulates
        the gradient of its weight meanwhile, and its A becomes that gradient's leading right singular vectors
        (LoRALinear.init_from_gradient). reduce averages a gradient over data-parallel ranks, so that every rank
        starts the same booster. orthogonal (--xgblora_init gradient-orthogonal): among the input directions that no
        merged booster of the layer took, so that the boosters build rank; from the full gradient, successive
        boosters start on much the same direction (BENCHMARKS.md, the rank-limited task).

        Zeroth-order training has no such start: the mean of n two-point estimates of a layer's (out, in) gradient G
        is G plus noise of about iid entries of std |g| / sqrt(n) (g the gradient of everything perturbed together),
        and the estimate's leading singular vectors carry nothing of G's until s_1(G) passes the noise's spiked-
        matrix threshold (|g| / sqrt(n)) (out in)^(1/4), i.e. until n exceeds sqrt(out in) (|g| / s_1(G))^2: 576
        forward pairs at a 576 x 576 layer even for a rank-1 G alone in the model, more per layer and booster than
        the booster's own steps. So it needs a backward pass.
        """
        active = self.active_modules()
        for m in active.values():
            m.start_weight_grad()
        try:
            backward([m.lora_B for m in active.values()])
        finally:
            grads = {name: m.take_weight_grad() for name, m in active.items()}
        for name, m in active.items():
            m.init_from_gradient(grads[name] if reduce is None else reduce(grads[name]),
                                 self.taken_directions(name) if orthogonal else None)
            m.lora_A.grad = m.lora_B.grad = None
        self._start_tracking()  # the adaptive merge rolls back to this start, not to the random one

    def taken_directions(self, name: str) -> torch.Tensor | None:
        """Orthonormal rows (k, in) spanning the A rows of every merged booster of module `name` (None before any)."""
        rows = [record["modules"][name]["A"] for record in self.history if name in record["modules"]]
        if not rows:
            return None
        u, s, _ = torch.linalg.svd(torch.cat(rows).double().T, full_matrices=False)
        return u[:, s > s[0] * 1e-6].T.float()

    # ------------------------------------------------------------------ schedule

    def plan(self, steps_per_iteration: int, max_steps: int, chosen: bool = True) -> None:
        """Fix the steps per booster for a run of max_steps; say so when the run would merge fewer than 2 boosters,
        as a warning when the user's flags (`chosen`) rather than the defaults set the length."""
        self.steps_per_iteration = steps_per_iteration
        merges = max_steps // steps_per_iteration
        if merges < 2 and not self.adaptive:
            (log.warning if chosen else log.info)(
                "XGBLoRA: %d steps at %d steps per booster merge %d booster(s): this run is rank-%d LoRA; set "
                "--xgblora_num_boosters (or a smaller --xgblora_steps_per_iteration)", max_steps, steps_per_iteration,
                merges, next(iter(self.modules.values())).r)

    @property
    def booster_start(self) -> int:
        """The step at which the current booster started (the last merge's step)."""
        return self.history[-1]["step"] if self.history else 0

    def after_step(self, step: int, loss: float | None,
                   forget: Callable[[Iterable[torch.nn.Parameter]], None] | None = None) -> dict[str, Any] | None:
        """Call after every optimizer step (1-based count); merges the booster when it is due and says so.

        forget(params) is told which weights were re-initialised, so the optimizer drops their state.
        """
        if self.adaptive:
            capped = step - self.booster_start >= (self.max_booster_steps or self.steps_per_iteration)
            plateau = loss is not None and math.isfinite(loss) and self._observe(float(loss))  # skipped: no signal
            if not (plateau or capped):
                return None
            if plateau:
                self._rollback()
        elif step % self.steps_per_iteration:
            return None
        return self._merge(step, forget)

    def _merge(self, step: int, forget: Callable[[Iterable[torch.nn.Parameter]], None] | None) -> dict[str, Any]:
        active = self.active_modules()
        booster = len(self.history) + 1
        record = {}
        for name, m in active.items():
            record[name] = {"A": _cpu_copy(m.lora_A), "B": _cpu_copy(m.lora_B), "scale": self.shrinkage * m.scaling}
            m.merge(self.shrinkage)
        self.history.append({"booster": booster, "step": step, "modules": record})
        for m in active.values():
            m.reset(self._generator)
            m.lora_A.grad = m.lora_B.grad = None
        if forget is not None:
            forget([p for m in active.values() for p in (m.lora_A, m.lora_B)])
        self._choose_subset()
        self._start_tracking()
        log.info("XGBLoRA: merged booster %d at step %d", booster, step)
        return {"event": "merge", "booster": booster, "step": step, "modules": len(active)}

    # ------------------------------------------------------------------ adaptive merge

    def _start_tracking(self) -> None:
        """A new booster must improve on the loss EMA as it stands when the booster starts."""
        self._best, self._since_best = self._ema, 0
        self._snapshot = self._capture() if self.adaptive else None

    def _capture(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: (m.lora_A.detach().clone(), m.lora_B.detach().clone())
                for name, m in self.active_modules().items()}

    def _observe(self, loss: float) -> bool:
        """Update the loss EMA; True when it has not improved by `threshold` (relative) for `patience` steps."""
        self._ema = loss if self._ema is None else self.ema * self._ema + (1.0 - self.ema) * loss
        if self._best is None or self._ema < self._best - self.threshold * abs(self._best):
            self._best, self._since_best, self._snapshot = self._ema, 0, self._capture()
        else:
            self._since_best += 1
        return self._since_best >= self.patience

    @torch.no_grad()
    def _rollback(self) -> None:
        for name, (A, B) in (self._snapshot or {}).items():
            self.modules[name].lora_A.copy_(A)
            self.modules[name].lora_B.copy_(B)

    # ------------------------------------------------------------------ penalty and state

    def norm_penalty(self, weight: float) -> torch.Tensor:
        """weight * sum(|A|^2 + |B|^2) over the active modules, as a differentiable 0-dim tensor."""
        terms = [m.lora_A.square().sum() + m.lora_B.square().sum() for m in self.active_modules().values()]
        if not terms:
            return torch.zeros(())
        return weight * torch.stack(terms).sum()

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs beyond the model's weights: history, generator, subset, EMA state."""
        snapshot = None if self._snapshot is None else {
            name: {"A": _cpu_copy(A), "B": _cpu_copy(B)} for name, (A, B) in self._snapshot.items()}
        return {"blocks": list(self._block_names), "history": list(self.history),
                "generator": self._generator.get_state(), "subset": list(self.subset), "ema": self._ema,
                "best": self._best, "since_best": self._since_best, "snapshot": snapshot}

    def _restore_side_factors(self) -> None:
        """A 4-bit base holds its merged boosters as side factors, not in its (unsaved) weight: rebuild them from
        the history."""
        quantized = {name: m for name, m in self.modules.items() if is_quantized(m.base)}
        for m in quantized.values():
            m.clear_merged()
        for booster in self.history:
            for name, rec in booster["modules"].items():
                if name in quantized:
                    quantized[name].merge_factors(rec["A"], rec["B"], rec["scale"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned (the model's adapter and base weights are restored separately)."""
        if list(state["blocks"]) != self._block_names:
            raise UserError("the checkpoint's XGBLoRA layers do not match this model's adapted layers")
        self.history = list(state["history"])
        self._restore_side_factors()
        self._generator.set_state(state["generator"])
        self._apply_subset(list(state["subset"]))
        self._ema, self._best, self._since_best = state["ema"], state["best"], int(state["since_best"])
        snapshot = state["snapshot"]
        self._snapshot = None if snapshot is None else {
            name: (s["A"].to(self.modules[name].lora_A.device), s["B"].to(self.modules[name].lora_B.device))
            for name, s in snapshot.items()}
