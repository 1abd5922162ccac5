"""Device-level speed facts and defaults: TF32 on Ampere+, peak memory, native bf16 on this CPU."""

from __future__ import annotations

import resource

import torch


def enable_tf32(device: torch.device) -> bool:
    """Allow TF32 matmuls/convolutions on CUDA devices of compute capability 8.0+; returns whether it was enabled."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: CUDA max allocated on a GPU, else the process's peak RSS (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_has_bf16() -> bool:
    """Whether this CPU advertises native bf16 arithmetic (x86 avx512_bf16 or AMX, Arm's bf16 feature)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def native_bf16() -> bool:
    """Whether bf16 runs natively here: the GPU's support when there is one, else the CPU's flags."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else cpu_has_bf16()
