"""Timing: workloads run round-robin (interleaved) and summarised by medians; the per-record cost of the metrics log."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xgblora.logs import MetricsLog


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on a CUDA device, so that a clock reading covers it; nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(workloads: dict[str, Callable[[], Any]], repeats: int, warmup: int,
                     device: torch.device) -> dict[str, list[float]]:
    """Run the workloads round-robin (warmup rounds untimed), returning each one's per-run seconds."""
    times: dict[str, list[float]] = {name: [] for name in workloads}
    for rep in range(warmup + repeats):
        for name, fn in workloads.items():
            sync_device(device)
            start = time.perf_counter()
            fn()
            sync_device(device)
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def median(xs: list[float]) -> float:
    """The median of the timings, NaN when there are none."""
    return statistics.median(xs) if xs else float("nan")


def log_overhead(step_s: float, n: int = 500) -> dict[str, float]:
    """Mean cost of one MetricsLog.log (the train loop's per-step record, default buffering) over a step's time."""
    with tempfile.TemporaryDirectory() as tmp, MetricsLog(Path(tmp) / "metrics.jsonl") as metrics:
        loss = torch.tensor(1.2345)
        start = time.perf_counter()
        for step in range(1, n + 1):
            metrics.log({"step": step, "loss": float(loss), "lr": 1e-4, "elapsed_s": round(step * 0.1, 3)})
        per_log = (time.perf_counter() - start) / n
    return {"log_s_per_record": per_log, "log_overhead_fraction": per_log / step_s}


def step_callback(on_step: Callable[[int], None]) -> Any:
    """A TrainerCallback calling on_step(global_step) at the end of every TRL step."""
    from transformers import TrainerCallback

    class OnStep(TrainerCallback):
        def on_step_end(self, targs, tstate, control, **kwargs):  # noqa: ARG002
            on_step(tstate.global_step)
            return control

    return OnStep()
