"""Liger-Kernel's Triton kernels in a model (`--use_liger_kernel`, TRL's name), through transformers' own
integration (`transformers.integrations.liger.apply_liger_kernel`, what TRL's trainers call): the decoder's RMSNorm,
RoPE and SwiGLU. Liger's cross-entropy and fused linear cross-entropy stay off: they patch the model's forward to
compute its loss, while xgblora's losses read the hidden states through its own fused LM head (models/fused_head.py),
which keeps no [tokens, vocabulary] logits either."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from xgblora.errors import UserError

LIGER_KERNELS = {"rms_norm": True, "rope": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def use_liger_kernels(model: nn.Module, device: torch.device) -> None:
    """Patch the model's decoder with Liger's kernels; a one-line UserError off CUDA or without the package."""
    if device.type != "cuda":
        raise UserError(f"--use_liger_kernel: Liger's kernels are Triton kernels for CUDA devices; this run is on "
                        f"{device.type}")
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError("--use_liger_kernel needs the liger-kernel package: pip install liger-kernel")
    from transformers.integrations.liger import apply_liger_kernel

    apply_liger_kernel(model, LIGER_KERNELS)
