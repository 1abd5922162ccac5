"""Throughput, memory and limit-ratio measurements against baselines (`xgblora bench`).

Every headline figure is a ratio of two workloads timed side by side in one process, interleaved (A, B, A, B, ...)
and summarised by medians, so that noise from other processes on the machine hits both sides alike. Peak memory is
measured per workload in a fresh subprocess (RSS is a process-lifetime peak on the CPU).

Modules, one concern each:
    flags      the command's flags, and --quick
    workloads  synthetic data and `Bench`: the models, batches and step functions that are timed
    timing     interleaved timing, medians, device sync, the metrics log's per-record cost
    memory     peak memory per workload, each in its own subprocess
    baselines  HF Trainer + PEFT LoRA training; scoring one (example, candidate) pair per forward
    table      targets, verdicts, the printed table
    suite      `run` (every figure) and `main` (the command)

The public names below load their module on first use. `xgblora` builds its parser with `add_arguments` on every
command, and a memory worker's RSS counts every module it imports: neither must pay for torch, the models or the
HF Trainer + PEFT baseline they do not use.
"""

from __future__ import annotations

import importlib
from typing import Any

from xgblora.bench.flags import add_arguments, apply_quick

_EXPORTS = {
    "Bench": "workloads", "eval_examples": "workloads", "synthetic_examples": "workloads",
    "synthetic_seqs": "workloads",
    "time_interleaved": "timing", "median": "timing", "sync_device": "timing", "log_overhead": "timing",
    "MEMORY_WORKLOADS": "memory", "RssSampler": "memory", "memory_worker": "memory", "measure_memory": "memory",
    "hf_vs_xgblora": "baselines", "per_candidate_scores": "baselines", "eval_comparison": "baselines",
    "TARGETS": "table", "REQUIRED_KEYS": "table", "format_table": "table",
    "run": "suite", "main": "suite",
}
__all__ = ["add_arguments", "apply_quick", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """A public name of a submodule, imported on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
