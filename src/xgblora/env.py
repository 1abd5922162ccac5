"""`xgblora env`: versions, device, attention backends and what xgblora's defaults choose on this machine."""

from __future__ import annotations

import importlib.util
import os
import platform
from typing import Any

import torch
import transformers

from xgblora.models.gguf import cache_dir
from xgblora.models.pretrained import choose_attention, choose_device
from xgblora.perf import cpu_has_bf16


def environment() -> dict[str, Any]:
    """Versions, device, attention backends and what xgblora's defaults choose on this machine."""
    device = choose_device("auto")
    cuda = device.type == "cuda"
    report: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "bf16_supported": torch.cuda.is_bf16_supported() if cuda else cpu_has_bf16(),
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "peft_installed": importlib.util.find_spec("peft") is not None,
        "gguf_cache": str(cache_dir()),
    }
    if cuda:
        report["sdpa_backends"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}
        report["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    report["defaults"] = {
        "device": str(device), "attn_implementation": choose_attention("auto", device),
        "autocast": "bf16" if cuda and torch.cuda.is_bf16_supported() else
                    "none (fp32; --bf16 to enable on this CPU)" if not cuda and report["bf16_supported"] else
                    "none (fp32; no native bf16 here, where --bf16 would be emulated and slow)",
        "fused_adamw": True, "tf32": cuda and torch.cuda.get_device_capability(device)[0] >= 8,
        "use_cache_in_training": False, "padding": "dynamic, left, length-grouped",
        "zo_estimator": "mezo, optimizer sgd (--trainer zo; --zo_estimator mezo|fzoo|svrg|nspsa|es, "
                        "--zo_optimizer sgd|momentum|adam)",
        "packing": "on (flash attention, models that keep packed sequences apart)"
                   if choose_attention("auto", device).startswith("flash") else "off (--packing to force)",
    }
    return report
