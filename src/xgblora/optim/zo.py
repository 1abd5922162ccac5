"""Zeroth-order optimisation (MeZO, Malladi et al. 2023): seeded perturbations, two-point estimate, update.

`SeededZO` is what every zeroth-order estimator shares: the step seeds, z rebuilt from a seed, in-place
perturbation, the dual batch (the adapters' member mode with two members, +z and -z), and the update (in place from
the seeds, or torch's SGD-momentum / AdamW fed the estimate as the gradient). `MeZO.step(loss_fn, batch, lr)` is
the algorithm; the other estimators (FZOO, MeZO-SVRG, n-SPSA) live in `optim.zo_estimators`. `ZOStepper.step(next_batch, lr)` is what the training loop
calls (the same interface as the AdamW stepper): one batch, one estimator step, the NaN policy, the loss as a tensor.

How z is drawn (a test or another rank rebuilds it from this alone):

* step seeds: ``rng = torch.Generator().manual_seed(seed)``; each step draws
  ``s = int(torch.randint(2**62, (1,), generator=rng))`` (kept as ``MeZO.last_seed``).
* z of that step: one generator per device that holds trainable weights,
  ``gen = torch.Generator(device).manual_seed(s)``; then, in ``named_params`` order (repeats dropped,
  weights with ``requires_grad=False`` at step time skipped),
  ``z_p = torch.normal(0.0, 1.0, p.shape, generator=gen, device=p.device, dtype=p.dtype)`` for a weight of
  fewer than ``2 * _CHUNK`` elements: fp32 for fp32 and adapter weights, the weight's own dtype for
  half-precision weights. A larger weight's z is drawn with ``normal_`` in pieces of ``_CHUNK`` elements of the
  flattened weight (the last piece takes the remainder), one after the other from the same generator. On the
  CPU the pieces concatenate to the whole-tensor draw bit for bit (CPU ``normal_`` fills uniforms in element
  order and transforms them in aligned blocks of 16; tests/test_zo.py checks it); on a GPU they are another
  draw of the same law, and the pieces are the definition. Pieces let a sweep reuse one buffer instead of
  allocating a z as large as the largest weight (the embedding) three times per step, and they bound the fp32
  copies of a half-precision update to a piece.
* stochastic rounding draws from a second generator per device seeded with ``s + 1`` (``s`` of the step's first
  seed); z never depends on it.
* Rademacher estimators (FZOO) use ``u = sign(z)`` of the same draw: +-1 with probability 1/2 each.
* an estimator that needs n perturbations in a step draws n step seeds from ``rng``, one after the other.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

import torch
from torch import Tensor, nn

from xgblora.adapters.lora import LoRALinear, MemberRows
from xgblora.data.batches import Batch
from xgblora.optim.fo import decays

log = logging.getLogger("xgblora")

HALF_DTYPES = (torch.float16, torch.bfloat16)
T = TypeVar("T")
_SEED_BOUND = 2**62
_CHUNK = 2**22  # elements of z drawn at a time on the CPU (a multiple of 16; see the module docstring)

ZO_OPTIMIZERS = ("sgd", "momentum", "adam")

Trainable = list[tuple[nn.Parameter, bool]]  # (weight, whether it gets weight decay)
Generators = dict[torch.device, torch.Generator]
Terms = list[tuple[int, float]]  # an estimate sum_i c_i z(s_i) as its (seed s_i, coefficient c_i) pairs


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> Tensor:
    """Round fp32 x to dtype: to one of its two neighbours, at random by proximity, so E[result] = x."""
    if dtype == torch.bfloat16 and x.dtype == torch.float32:
        return _stochastic_round_bf16(x, generator)
    near = x.to(dtype)
    back = near.to(x.dtype)
    diff = x - back
    other = torch.nextafter(near, torch.full_like(near, math.inf).masked_fill_(diff <= 0, -math.inf))
    chance = diff.div_(other.to(x.dtype) - back)  # in [0, 1/2]; NaN (never taken) for inf and NaN inputs
    draw = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return torch.where(draw < chance, other, near)


def _stochastic_round_bf16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """bf16 is the upper half of fp32's bits: adding a uniform 16-bit integer to the bits carries into the upper
    half with probability (lower half) / 2^16, the distance to the lower neighbour in ulps; truncating then leaves
    the neighbour. The same law as the general path in four passes over x instead of about twelve; +-inf and
    quiet NaNs stay as they are, and the largest finite values may round to inf, as nextafter does."""
    noise = torch.randint(0, 2**16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    bits = noise.add_(x.view(torch.int32)).bitwise_and_(-(2**16))
    return bits.view(torch.float32).to(torch.bfloat16)


def _pieces(t: Tensor) -> list[Tensor]:
    """Views covering contiguous t as z is drawn: t itself below 2 * _CHUNK elements, else flat pieces of _CHUNK
    elements, the last taking the remainder."""
    n = t.numel()
    if n < 2 * _CHUNK:
        return [t]
    starts = list(range(0, n - _CHUNK + 1, _CHUNK))
    flat = t.view(-1)
    return [flat[start:end] for start, end in zip(starts, [*starts[1:], n], strict=True)]


class SeededZO:
    """The part every zeroth-order estimator shares; subclasses implement step(loss_fn, batch, lr) -> losses.

    It holds the trainable weights (repeats dropped; those with requires_grad=False at step time skipped), draws
    the step seeds, rebuilds z from a seed one tensor at a time (never held for all weights, except by the dual
    path for adapter-sized weights), perturbs the weights in place or through the dual batch, and applies an
    estimate given as seeds and coefficients, sum_i c_i z(s_i):

    * optimizer "sgd": theta <- theta (1 - lr wd) - lr sum_i c_i z_i in place, z regenerated from the seeds
      (half-precision weights in fp32 and rounded back stochastically; no state).
    * "momentum" / "adam": the estimate becomes each weight's .grad and torch's SGD (heavy ball, coefficient
      betas[0], L2 weight decay) or AdamW (decoupled decay) takes the step, as ZO-Bench runs ZO-SGD-momentum and
      ZO-Adam (Zhang et al., ICML 2024, github.com/ZO-Bench/ZO-LLM, zo-bench/trainer.py `zo_step`). Their state
      is one (momentum) or two (Adam) fp32 copies of the trainable weights, so they are for adapters and small models.

    Losses from data-parallel ranks are averaged by reduce_losses (one small all-reduce per step): every rank then
    holds the same estimate and, drawing the same seeds, applies the same update; no weight or gradient is sent.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], lr: float, eps: float,
                 weight_decay: float = 0.0, stochastic_rounding: bool | None = None,
                 dual_modules: dict[str, LoRALinear] | None = None, seed: int = 0,
                 reduce_losses: Callable[[Tensor], Tensor] | None = None, optimizer: str = "sgd",
                 betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8, penalty: float = 0.0):
        if eps <= 0:
            raise ValueError(f"{type(self).__name__} eps must be positive, got {eps}")
        # an L2 penalty in the loss (gradient penalty x theta, on the weights that decay): for plain and momentum
        # steps it is weight decay; AdamW's decay is decoupled, so under adam it joins the estimate in .grad, as
        # the penalty's gradient does under first-order AdamW
        self.lr, self.eps = lr, eps
        self.weight_decay = weight_decay if optimizer == "adam" else weight_decay + penalty
        self._grad_penalty = penalty if optimizer == "adam" else 0.0
        self.stochastic_rounding = stochastic_rounding
        first = {id(p): (p, decays(name)) for name, p in reversed(named_params)}
        self._params: Trainable = [first.pop(id(p)) for _, p in named_params if id(p) in first]
        self._dual = list(dual_modules.values()) if dual_modules is not None else None
        if self._dual is not None:
            owned = {id(t) for m in self._dual for t in (m.lora_A, m.lora_B)}
            stray = [name for name, p in named_params if id(p) not in owned]
            if stray:
                raise ValueError(f"dual-batch {type(self).__name__} trains adapter weights only; {stray[:3]} are not "
                                 f"in any dual module")
        self._rng = torch.Generator().manual_seed(seed)
        self._reduce_losses = reduce_losses  # data parallel: this rank's losses -> means over all ranks
        self._z_gens: Generators = {}
        self._round_gens: Generators = {}
        self._buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}  # z buffers, reused by every sweep
        self._optimizer = self._build_optimizer(optimizer, self.weight_decay, betas, adam_eps)
        self.projected_grad = 0.0
        self.last_seed: int | None = None

    def _build_optimizer(self, name: str, weight_decay: float, betas: tuple[float, float],
                         adam_eps: float) -> torch.optim.Optimizer | None:
        """None for "sgd" (updates in place from the seeds); torch's SGD-momentum or AdamW otherwise."""
        if name not in ZO_OPTIMIZERS:
            raise ValueError(f"zeroth-order optimizer must be one of {ZO_OPTIMIZERS}, got {name!r}")
        if name == "sgd":
            return None
        half = [p.dtype for p, _ in self._params if p.dtype in HALF_DTYPES]
        if half:
            raise ValueError(f"the {name} zeroth-order optimizer keeps its state in the weights' dtype, and "
                             f"{half[0]} weights would lose its small updates: train fp32 weights (adapters are "
                             f"fp32) or use the sgd optimizer")
        groups = [{"params": [p for p, decay in self._params if decay], "weight_decay": weight_decay},
                  {"params": [p for p, decay in self._params if not decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if name == "momentum":
            return torch.optim.SGD(groups, lr=self.lr, momentum=betas[0])
        return torch.optim.AdamW(groups, lr=self.lr, betas=betas, eps=adam_eps)

    def _next_seed(self) -> int:
        """The next step seed (also kept as last_seed)."""
        self.last_seed = int(torch.randint(_SEED_BOUND, (1,), generator=self._rng))
        return self.last_seed

    def _trainable(self) -> Trainable:
        """The weights this step trains: those with requires_grad now (XGBLoRA's inactive layers are not)."""
        return [(p, d) for p, d in self._params if p.requires_grad]

    def _reduce(self, losses: list[Tensor]) -> list[float]:
        """The step's losses as floats, averaged over data-parallel ranks: the one host sync of a step."""
        stacked = torch.stack(losses)
        if self._reduce_losses is not None:
            stacked = self._reduce_losses(stacked)
        return stacked.tolist()

    def _pair_losses(self, loss_fn: Callable[[Batch], Tensor], batch: Batch, params: Trainable,
                     seed: int) -> tuple[Tensor, Tensor]:
        """L(theta + eps z) and L(theta - eps z) for the z of seed; the weights are left at theta."""
        if self._dual is not None:
            return self._dual_losses(loss_fn, batch, params, self._zs(params, seed))
        plus, minus = self._two_pass_losses(loss_fn, batch, params, seed)
        self._perturb(params, seed, self.eps)
        return plus, minus

    def _zs(self, params: Trainable, seed: int) -> list[Tensor]:
        """Every weight's z of seed, held at once (member mode's perturbed factors are built from them)."""
        gens = self._seeded(self._z_gens, params, seed)
        return [self._z(p, gens) for p, _ in params]

    def _one_sided_loss(self, loss_fn: Callable[[Batch], Tensor], batch: Batch, params: Trainable, seed: int,
                        sign: bool = False) -> Tensor:
        """L(theta + eps z) for the z of seed (sign: of sign(z)); the weights are left at theta (also on error)."""
        self._perturb(params, seed, self.eps, sign)
        try:
            return loss_fn(batch).mean()
        finally:
            self._perturb(params, seed, -self.eps, sign)

    def _two_pass_losses(self, loss_fn: Callable[[Batch], Tensor], batch: Batch,
                         params: Trainable, seed: int) -> tuple[Tensor, Tensor]:
        """L+ at theta + eps z, L- at theta - eps z; leaves the weights at theta - eps z (theta on error)."""
        offset = 0.0
        try:
            self._perturb(params, seed, self.eps)
            offset = self.eps
            plus = loss_fn(batch).mean()
            self._perturb(params, seed, -2 * self.eps)
            offset = -self.eps
            minus = loss_fn(batch).mean()
        except BaseException:
            if offset:
                self._perturb(params, seed, -offset)
            raise
        return plus, minus

    def _dual_losses(self, loss_fn: Callable[[Batch], Tensor], batch: Batch,
                     params: Trainable, zs: list[Tensor]) -> tuple[Tensor, Tensor]:
        """L+ and L- from one forward over the doubled batch, each adapter branch perturbed per half."""
        with self._as_members(params, [(zs, 1.0), (zs, -1.0)]):
            losses = loss_fn(batch.doubled())
        if losses.shape[0] % 2:
            raise ValueError(f"dual-batch {type(self).__name__}: loss_fn gave {losses.shape[0]} losses for a "
                             f"doubled batch; it must give one per row")
        half = losses.shape[0] // 2
        return losses[:half].mean(), losses[half:].mean()

    @contextlib.contextmanager
    def _as_members(self, params: Trainable, members: list[tuple[list[Tensor], float]],
                    rows: MemberRows | None = None) -> Iterator[None]:
        """The forwards inside run every dual module in member mode: member k's factors are theta + sign_k eps z_k
        (z_k: a z per weight of params, in its order); a module none of whose factors train keeps its own."""
        where = {id(p): i for i, (p, _) in enumerate(params)}
        perturbed = []
        try:
            for m in self._dual:
                a, b = where.get(id(m.lora_A)), where.get(id(m.lora_B))
                if a is not None or b is not None:
                    m.set_members(self._stacked(m.lora_A, a, members), self._stacked(m.lora_B, b, members), rows)
                    perturbed.append(m)
            yield
        finally:
            for m in perturbed:
                m.clear_members()

    def _stacked(self, factor: nn.Parameter, i: int | None, members: list[tuple[list[Tensor], float]]) -> Tensor:
        """The members' copies of one factor [K, ...]: perturbed by their z of weight i, or all alike (i None)."""
        base = factor.detach()
        if i is None:
            return base.expand(len(members), *base.shape)
        return torch.stack([torch.add(base, zs[i], alpha=sign * self.eps) for zs, sign in members])

    def _perturb(self, params: Trainable, seed: int, scale: float, sign: bool = False) -> None:
        """theta += scale z (sign: scale sign(z)), regenerating z one tensor (on the CPU, one piece) at a time."""
        gens = self._seeded(self._z_gens, params, seed)
        for p, _ in params:
            for piece, z in self._z_pieces(p, gens, sign):
                piece.add_(z, alpha=scale)

    def _apply(self, params: Trainable, terms: Terms, lr: float, sign: bool = False) -> None:
        """theta <- theta - lr (sum_i c_i z(s_i) + decay), by the optimizer (see the class docstring)."""
        if self._optimizer is not None:
            self._optimizer_step(params, terms, lr, sign)
            return
        round_gens = self._seeded(self._round_gens, params, terms[0][0] + 1)
        for k, (seed, coefficient) in enumerate(terms):
            gens = self._seeded(self._z_gens, params, seed)
            for p, decay in params:
                wd = self.weight_decay if decay and k == 0 else 0.0  # decay once per step
                for piece, z in self._z_pieces(p, gens, sign):
                    self._update(piece, z, 0.0, coefficient, lr, wd, round_gens)

    def _optimizer_step(self, params: Trainable, terms: Terms, lr: float, sign: bool) -> None:
        """The estimate as each weight's .grad, then one step of the torch optimizer at lr."""
        for k, (seed, coefficient) in enumerate(terms):
            gens = self._seeded(self._z_gens, params, seed)
            for p, _ in params:
                z = self._z(p, gens, sign)
                if k == 0:
                    p.grad = z.mul_(coefficient)
                else:
                    p.grad.add_(z, alpha=coefficient)
        if self._grad_penalty:
            for p, decay in params:
                if decay:
                    p.grad.add_(p.detach(), alpha=self._grad_penalty)
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        self._optimizer.step()
        for p, _ in params:
            p.grad = None

    def _update(self, p: nn.Parameter, z: Tensor, shift: float, g: float | None, lr: float, wd: float,
                round_gens: Generators) -> None:
        """theta += shift z (restore), then theta <- theta (1 - lr wd) - lr g z (half precision: in fp32)."""
        half = p.dtype in HALF_DTYPES
        if g is not None and not half and not wd:
            p.add_(z, alpha=shift - lr * g)  # restore and update in one pass over the weights
            return
        if shift:
            p.add_(z, alpha=shift)  # in p's dtype, like the perturbations: sub-ulp ones are undone exactly
        if g is None:
            return
        theta = p.to(torch.float32) if half else p
        if wd:
            theta.mul_(1 - lr * wd)
        theta.add_(z, alpha=-lr * g)  # a half z into fp32 theta: no fp32 copy of z
        if half:
            p.copy_(theta if self.stochastic_rounding is False else
                    stochastic_round(theta, p.dtype, round_gens[p.device]))

    @staticmethod
    def _z(p: nn.Parameter, gens: Generators, sign: bool = False) -> Tensor:
        """p's z (sign: sign(z)) as a new tensor (the dual path holds the adapters' z for the whole step)."""
        z = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        for piece in _pieces(z):
            piece.normal_(generator=gens[p.device])
        return z.sign_() if sign else z

    def _z_pieces(self, p: nn.Parameter, gens: Generators, sign: bool = False) -> Iterator[tuple[Tensor, Tensor]]:
        """(view of p, its z) pieces covering p; z lives in a reused buffer, valid until the next piece."""
        if not p.is_contiguous():
            yield p, self._z(p, gens, sign)
            return
        key, size = (p.device, p.dtype), min(p.numel(), 2 * _CHUNK)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[key] = torch.empty(size, dtype=p.dtype, device=p.device)
        for piece in _pieces(p):
            z = buffer[:piece.numel()].view(piece.shape).normal_(generator=gens[p.device])
            yield piece, z.sign_() if sign else z

    @staticmethod
    def _seeded(cache: Generators, params: Trainable, seed: int) -> Generators:
        """One generator per device of the weights, each (re)seeded with seed."""
        for p, _ in params:
            if p.device not in cache:
                cache[p.device] = torch.Generator(p.device)
        for gen in cache.values():
            gen.manual_seed(seed)
        return cache

    def forget(self, params: Iterable[nn.Parameter]) -> None:
        """Drop the optimizer state of re-initialised weights (a merged XGBLoRA booster starts afresh)."""
        if self._optimizer is not None:
            for p in params:
                self._optimizer.state.pop(p, None)

    def state_dict(self) -> dict:
        """The step-seed generator's state (all a resumed run needs to draw the same z), the last estimate, and
        the momentum or Adam state where there is one."""
        state = {"rng": self._rng.get_state(), "projected_grad": self.projected_grad, "last_seed": self.last_seed}
        if self._optimizer is not None:
            state["optimizer"] = self._optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""
        self._rng.set_state(state["rng"])
        self.projected_grad = state["projected_grad"]
        self.last_seed = state["last_seed"]
        if self._optimizer is not None:
            self._optimizer.load_state_dict(state["optimizer"])


class MeZO(SeededZO):
    """MeZO-SGD: theta <- theta - lr (g z + wd theta), g = (L(theta + eps z) - L(theta - eps z)) / (2 eps).

    Two-pass path: three in-place sweeps per step (+eps z, -2 eps z, then +eps z fused with the update),
    z regenerated from the step seed one tensor at a time and never held for all weights. Dual path
    (dual_modules given; adapter weights only): one forward over the batch concatenated with itself, rows
    [:B] at +eps z and rows [B:] at -eps z, the weights themselves untouched until the update.
    Half-precision weights are updated in fp32 one tensor at a time and rounded back stochastically
    (round-to-nearest when stochastic_rounding is False), so updates below half an ulp survive on average.
    When the estimate is not finite the weights are restored and not updated. With a momentum or Adam
    optimizer, g z goes to it instead (MeZO-momentum, ZO-Adam).
    """

    @torch.no_grad()
    def step(self, loss_fn: Callable[[Batch], Tensor], batch: Batch,
             lr: float | None = None) -> tuple[float, float]:
        """One step; loss_fn(batch) gives per-example losses [B]; returns (L+, L-) after one host sync."""
        lr = self.lr if lr is None else lr
        seed = self._next_seed()
        params = self._trainable()
        if self._dual is not None:
            gens = self._seeded(self._z_gens, params, seed)
            zs = [self._z(p, gens) for p, _ in params]  # adapter-sized, held for this step only
            plus, minus = self._dual_losses(loss_fn, batch, params, zs)
        else:
            plus, minus = self._two_pass_losses(loss_fn, batch, params, seed)
        plus_f, minus_f = self._reduce([plus, minus])
        g = (plus_f - minus_f) / (2 * self.eps)
        self.projected_grad = g
        usable = g if math.isfinite(g) else None
        if self._optimizer is not None:
            if self._dual is None:
                self._perturb(params, seed, self.eps)  # back to theta from theta - eps z
            if usable is not None:
                self._apply(params, [(seed, usable)], lr)
            return plus_f, minus_f
        round_gens = self._seeded(self._round_gens, params, seed + 1)
        if self._dual is not None:
            for (p, decay), z in zip(params, zs, strict=True):
                self._update(p, z, 0.0, usable, lr, self.weight_decay if decay else 0.0, round_gens)
        else:  # the weights sit at theta - eps z: restore them in the same sweep
            gens = self._seeded(self._z_gens, params, seed)
            for p, decay in params:
                for piece, z in self._z_pieces(p, gens):
                    self._update(piece, z, self.eps, usable, lr, self.weight_decay if decay else 0.0, round_gens)
        return plus_f, minus_f


class Estimator(Protocol):
    """A zeroth-order estimator's step on one batch: the losses it measured (their mean is the step's training
    loss; a non-finite one means the update was skipped) after updating the weights at lr."""

    def step(self, loss_fn: Callable[[Batch], Tensor], batch: Batch, lr: float | None = None) -> tuple[float, ...]: ...

    def forget(self, params: Iterable[nn.Parameter]) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class FirstOrderHead(Protocol):
    """A head trained first-order beside MeZO (`head.HeadTrainer`): it runs MeZO's step and learns from its forwards."""

    def train_on(self, forwards: Callable[[], T], batch: Batch) -> T: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ZOStepper:
    """The loop's zeroth-order step: next_batch() -> one estimator step at lr -> the mean of its losses as a device
    tensor (MeZO: (L+ + L-) / 2).

    A non-finite estimate leaves the weights as they were (the estimator restores them); under --nan_policy skip
    that is said at once, under stop the loop raises at its next logging step.
    """

    def __init__(self, mezo: Estimator, loss_fn: Callable[[Batch], Tensor], *, nan_policy: str = "stop",
                 device: torch.device | str = "cpu", head: FirstOrderHead | None = None):
        self.mezo = mezo  # the estimator: MeZO, or one of optim.zo_estimators
        self.loss_fn, self.nan_policy, self.device, self.head = loss_fn, nan_policy, torch.device(device), head

    def step(self, next_batch: Callable[[], Batch], lr: float) -> Tensor | None:
        """One estimator step on the next batch (and the head's first-order step); returns the mean loss."""
        batch = next_batch()
        if self.head is None:
            losses = self.mezo.step(self.loss_fn, batch, lr=lr)
        else:
            losses = self.head.train_on(lambda: self.mezo.step(self.loss_fn, batch, lr=lr), batch)
        return self._report(losses)

    def _report(self, losses: tuple[float, ...]) -> Tensor | None:
        """The mean of the step's losses as a device tensor; a non-finite one is said at once under skip. None,
        said at once, for a step that measured no loss (evolution strategies with no member scored)."""
        if not losses:
            log.warning("no member of the population has a finite loss (under --zo_objective reward: none of its "
                        "completions was scored); the step leaves the weights as they were")
            return None
        total = sum(losses)
        if not math.isfinite(total) and self.nan_policy == "skip":
            log.warning("non-finite zeroth-order loss; update skipped (--nan_policy skip)")
        return torch.tensor(total / len(losses), device=self.device)

    def forget(self, params: Iterable[nn.Parameter]) -> None:
        """Drop the estimator's per-weight state (momentum, Adam moments, an SVRG anchor) of re-initialised weights."""
        self.mezo.forget(params)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Zeroth-order training is not sharded: every rank holds the whole model and applies the same update."""
        return model

    def state_dict(self) -> dict:
        """The estimator's state (its step-seed generator, optimizer state) and the first-order head's AdamW state."""
        return {"zo": self.mezo.state_dict(),
                **({"head": self.head.state_dict()} if self.head is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""
        self.mezo.load_state_dict(state["zo"])
        if self.head is not None:
            self.head.load_state_dict(state["head"])
