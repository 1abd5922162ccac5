"""First-order optimisation: AdamW (no decay on biases and norms), learning-rate schedules, clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import get_scheduler

from xgblora.errors import UserError

# Fused AdamW on the CPU (torch 2.13, 2-core Xeon, fp32, time per optimizer.step(), best of 3):
#   LoRA r=8 on q,v of OPT-125m (0.29M params, 48 tensors):   default 1.97 ms, foreach 1.56 ms, fused 0.45 ms
#   all of OPT-125m               (125.2M params, 196 tensors): default 358 ms, foreach 391 ms,  fused 92 ms
# so fused is the default on the CPU as well as on CUDA (fused CPU AdamW exists since torch 2.4, our minimum).
_FUSED_DEVICE_TYPES = ("cuda", "cpu")

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


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


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, max_steps: int,
                    warmup_steps: int = 0) -> torch.optim.lr_scheduler.LRScheduler:
    """Learning-rate schedule: constant, linear to 0, or cosine to 0, each after a linear warm-up."""
    if kind not in SCHEDULES:
        raise UserError(f"unknown --lr_scheduler_type {kind!r}: choose one of {', '.join(SCHEDULES)}")
    return get_scheduler(SCHEDULES[kind], optimizer, num_warmup_steps=warmup_steps,
                         num_training_steps=max_steps)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor | None:
    """Clip the gradients' global 2-norm to max_norm; return the norm before clipping (no host sync)."""
    if max_norm <= 0:
        return None
    return nn.utils.clip_grad_norm_(list(params), max_norm)
