"""First-order training: the AdamW stepper (gradient accumulation, micro-batches halved on out-of-memory, clipping,
the NaN policy, data-parallel gradient averaging), AdamW itself (no decay on biases and norms), clipping.

Contract of `AdamWStepper.step(next_batch, lr)`: it draws gradient_accumulation_steps batches, runs forward and
backward over each in micro-batches of at most `micro_batch` examples (each loss weighted by its share, so the
gradient is the whole batch's), averages gradients and loss over data-parallel ranks, clips, and applies AdamW at
`lr` unless the loss is not finite under the skip policy; it returns the mean loss as a device tensor (no host
sync). On CUDA out-of-memory the step starts over from zero gradients with the micro-batch halved.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from xgblora.data.batches import Batch
from xgblora.distributed import LOCAL, Distributed
from xgblora.errors import UserError

log = logging.getLogger("xgblora")

# Fused AdamW is the default on the CPU as well as on CUDA: it measured 3.5-4x faster than torch's default there
# (BENCHMARKS.md, "Fused AdamW on the CPU"); fused CPU AdamW exists since torch 2.4, our minimum.
_FUSED_DEVICE_TYPES = ("cuda", "cpu")


def decays(name: str) -> bool:
    """Whether a weight of this name gets weight decay: not biases, not norms (layer_norm, ln_f, ...)."""
    lowered = name.lower()
    if "bias" in lowered or "norm" in lowered:
        return False
    return not any(part.startswith("ln") for part in lowered.split("."))


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decayed weights, then biases and norms without decay; empty groups dropped."""
    named = list(named_params)
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW; fused=None picks the fused kernel when all parameters sit on CUDA, or all on the CPU."""
    groups = param_groups(named_params, weight_decay)
    if fused is None:
        device_types = {p.device.type for g in groups for p in g["params"]}
        fused = len(device_types) == 1 and device_types.pop() in _FUSED_DEVICE_TYPES
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor | None:
    """Clip the gradients' global 2-norm to max_norm; return the norm before clipping (no host sync)."""
    if max_norm <= 0:
        return None
    return nn.utils.clip_grad_norm_(list(params), max_norm)


def micro_batches(batch: Batch, size: int) -> Iterator[tuple[Batch, float]]:
    """Pieces of at most `size` examples covering the batch: (piece, its share of the batch's examples)."""
    n = batch.n_examples
    if size >= n:
        yield batch, 1.0
        return
    for start in range(0, n, size):
        stop = min(start + size, n)
        yield batch.split(start, stop), (stop - start) / n


class AdamWStepper:
    """One AdamW optimizer step per call of step(); see the module docstring for its contract."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], loss_fn: Callable[[Batch], Tensor], *,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 fused: bool | None = None, max_grad_norm: float = 1.0, accumulation: int = 1,
                 micro_batch: int, nan_policy: str = "stop", penalty: Callable[[], Tensor] | None = None,
                 dist: Distributed = LOCAL, offload: bool = False):
        self.named_params = named_params  # FSDP replaces its entries in place (prepare)
        self.loss_fn, self.penalty, self.dist = loss_fn, penalty, dist
        # --activation_offloading: what the forward saves for the backward goes to pinned host memory as it is saved
        # (the hooks travel with each saved tensor, so the backward needs no context of its own)
        self.saving = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=torch.cuda.is_available()) \
            if offload else contextlib.nullcontext
        self.optimizer = build_optimizer(named_params, 0.0, weight_decay, betas, eps, fused=fused)
        self.max_grad_norm, self.accumulation, self.nan_policy = max_grad_norm, accumulation, nan_policy
        self.micro_batch = micro_batch

    def step(self, next_batch: Callable[[], Batch], lr: float) -> Tensor:
        """One optimizer step at learning rate lr; returns the mean loss (a device tensor)."""
        batches = [next_batch() for _ in range(self.accumulation)]
        while True:
            try:
                total = self._accumulate(batches)
                break
            except torch.OutOfMemoryError:
                pass  # recovered below, once the error and the activations its traceback holds are released
            self.optimizer.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._halve_micro_batch(batches[0].n_examples)
        params = [p for _, p in self.named_params]
        total = self.dist.reduce_step(total, params)  # gradients and loss: means over ranks
        clip_grad_norm([p for p in params if p.grad is not None], self.max_grad_norm)
        if self.nan_policy == "skip" and not torch.isfinite(total):
            log.warning("non-finite loss; step skipped (--nan_policy skip)")
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _accumulate(self, batches: list[Batch]) -> Tensor:
        """Backward over the batches in micro-batches; returns the mean loss (penalty included)."""
        total = None
        for batch in batches:
            for piece, share in micro_batches(batch, self.micro_batch):
                weight = share / len(batches)
                with self.saving():
                    loss = self.loss_fn(piece).mean() * weight
                if self.penalty is not None:
                    loss = loss + self.penalty() * weight
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        return total

    def _halve_micro_batch(self, batch_size: int) -> None:
        """Halve the micro-batch after an out-of-memory error and say so; below one example, a UserError."""
        if self.micro_batch <= 1:
            raise UserError("CUDA out of memory with a micro-batch of 1 example already; try --gradient_checkpointing, "
                            "--activation_offloading, a smaller --max_length, or --trainer zo (MeZO keeps no "
                            "gradients or optimizer state)")
        self.micro_batch = (self.micro_batch + 1) // 2
        pieces = math.ceil(batch_size / self.micro_batch) * self.accumulation
        log.warning("CUDA out of memory: redoing the step with micro-batch %d and %d micro-batches per optimizer "
                    "step (the same global batch of %d and the same gradient)", self.micro_batch, pieces,
                    batch_size * self.accumulation)

    def forget(self, params: Iterable[nn.Parameter]) -> None:
        """Drop the optimizer state of re-initialised weights (a merged XGBLoRA booster starts afresh)."""
        for p in params:
            p.grad = None
            self.optimizer.state.pop(p, None)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Hand model and optimizer to the data-parallel engine (FSDP shards both); returns the model to run."""
        model, self.optimizer = self.dist.prepare(model, self.optimizer, self.named_params)
        return model

    def state_dict(self) -> dict:
        """The AdamW moments and step counts."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""
        self.optimizer.load_state_dict(state["optimizer"])
