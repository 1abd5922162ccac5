"""A 4-bit NF4 base model (QLoRA): bitsandbytes' NF4 with double quantisation, for transformers' loader and for
the built-in random models.

bitsandbytes, not torchao: both ran NF4 forward and backward on this CPU (bitsandbytes 0.50 through its CPU
backend, torchao 0.18 through its NF4 tensor subclass), but only bitsandbytes is what transformers' loader
quantises with while it reads the checkpoint (`BitsAndBytesConfig`: a 7B model never sits in 16-bit in memory),
with double quantisation as one flag, the layout PEFT's QLoRA and every QLoRA recipe use, and the same code path
on CUDA and CPU.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import torch
from torch import nn

from xgblora.errors import UserError

_IN_A_BLOCK = re.compile(r"\.\d+\.")  # ".3." in "model.layers.3.self_attn.q_proj": a numbered transformer block


def in_transformer_block(name: str) -> bool:
    """Whether a module (by qualified name) sits in a numbered transformer block: the linear layers PEFT's
    `all-linear` adapts and a built-in model quantises (never the LM head, a pooler or a classifier head)."""
    return bool(_IN_A_BLOCK.search(name))


def require_bitsandbytes() -> Any:
    """The bitsandbytes module; a one-line error when it is not installed."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("--load_in_4bit needs bitsandbytes (pip install 'bitsandbytes>=0.48'; it runs NF4 on the "
                        "CPU and on CUDA)")
    import bitsandbytes

    return bitsandbytes


def is_quantized(module: nn.Module) -> bool:
    """Whether a linear layer holds a 4-bit bitsandbytes weight (whose values cannot be added to in place)."""
    return type(getattr(module, "weight", None)).__name__ == "Params4bit"


def bnb_config(compute_dtype: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig for NF4, double quantisation, and matmuls in compute_dtype."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def quantize_linears(model: nn.Module, select: Any, compute_dtype: torch.dtype, device: torch.device) -> int:
    """Replace every nn.Linear whose name `select` accepts by a bitsandbytes NF4 Linear4bit on `device`
    (double quantisation); return how many. For models built in memory, which transformers' loader never sees."""
    bnb = require_bitsandbytes()
    chosen = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and select(name)]
    for name, linear in chosen:
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                                     quant_type="nf4")
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q.to(device))  # the move quantises the weight
    return len(chosen)


def keep_one_kernel(model: nn.Module) -> None:
    """Turn off bitsandbytes' repacking of a 4-bit weight for its avx512-bf16 CPU inference kernel. bitsandbytes
    0.50 rewrites the weight's layout the first time a layer runs in eval mode without gradients (every MeZO
    forward and every evaluation), asserts on layers whose outputs are not a multiple of 32 (a tiny model's 176),
    and would run MeZO and AdamW through different kernels; the packed kernel's speed is not measured here."""
    for module in model.modules():
        if _is_linear4bit(module):
            module.support_avx512bf16_for_cpu = False


def _is_linear4bit(module: nn.Module) -> bool:
    """A bitsandbytes Linear4bit layer."""
    return hasattr(module, "support_avx512bf16_for_cpu") and is_quantized(module)
