"""Timing: workloads run round-robin (interleaved) and summarised by medians (and mean, p90, max, every step); the
per-record cost of the metrics log."""

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


class InterleavedSteps:
    """A Trainer's steps timed against ours on the same batches, one step each in turn. With `alternate`, the side
    that meets a batch first alternates: on a GPU the first call with a new shape pays for choosing its kernels, and
    padded batches change shape every step, so a fixed order would charge that to one side; without it, ours always
    runs after the Trainer's. The Trainer's step is the time from one step's end to the next's (its data loading
    included), less our step when it ran in between. `ours(index)` runs our step on the rows of the Trainer's step
    `index` (0-based); pass `callback()` to the Trainer and call `start()` just before `train()`."""

    def __init__(self, ours: Callable[[int], Any], device: torch.device, warmup: int, alternate: bool = True) -> None:
        self.ours, self.device, self.warmup, self.alternate = ours, device, warmup, alternate
        self.trainer_s: list[float] = []
        self.ours_s: list[float] = []
        self._mark, self._ours_first_s = 0.0, 0.0

    def start(self) -> None:
        self._mark = time.perf_counter()

    def _run_ours(self, index: int) -> float:
        sync_device(self.device)
        start = time.perf_counter()
        self.ours(index)
        sync_device(self.device)
        return time.perf_counter() - start

    def _ours_first(self, index: int) -> bool:
        return self.alternate and index % 2 == 1

    def on_step_begin(self, index: int) -> None:
        if self._ours_first(index):
            self._ours_first_s = self._run_ours(index)

    def on_step_end(self, index: int) -> None:
        sync_device(self.device)
        first = self._ours_first(index)
        trainer_s = time.perf_counter() - self._mark - (self._ours_first_s if first else 0.0)
        ours_s = self._ours_first_s if first else self._run_ours(index)
        if index >= self.warmup:
            self.trainer_s.append(trainer_s)
            self.ours_s.append(ours_s)
        self._mark = time.perf_counter()

    def callback(self) -> Any:
        """The TrainerCallback: global_step counts the finished steps, so it is the index of a step at its begin."""
        from transformers import TrainerCallback

        steps = self

        class Interleave(TrainerCallback):
            def on_step_begin(self, targs, tstate, control, **kwargs):  # noqa: ARG002
                steps.on_step_begin(tstate.global_step)
                return control

            def on_step_end(self, targs, tstate, control, **kwargs):  # noqa: ARG002
                steps.on_step_end(tstate.global_step - 1)
                return control

        return Interleave()


def median(xs: list[float]) -> float:
    """The median of the timings, NaN when there are none."""
    return statistics.median(xs) if xs else float("nan")


def step_stats(xs: list[float]) -> dict[str, Any]:
    """Mean, median, p90 (linear interpolation between order statistics, numpy's default), max and the list of
    per-step seconds: a slow step shows in p90 and max where the mean alone would hide which step it was."""
    if not xs:
        return {"n": 0, "mean_s": None, "median_s": None, "p90_s": None, "max_s": None, "steps_s": []}
    ordered = sorted(xs)
    pos = 0.9 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    p90 = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return {"n": len(xs), "mean_s": statistics.fmean(xs), "median_s": statistics.median(xs), "p90_s": p90,
            "max_s": ordered[-1], "steps_s": list(xs)}


def against_trainer(trainer_times: list[float], our_times: list[float]) -> dict[str, Any]:
    """A comparison's timings against a trainer's (TRL's, run step by step beside ours): both sides' per-step seconds
    and their statistics, steps per second, and the speed-up, of the summed times and as the median per-step ratio."""
    trainer_s, our_s = sum(trainer_times), sum(our_times)
    return {"steps_timed": len(our_times), "trl_step_s": trainer_times, "xgblora_step_s": our_times,
            "xgblora_step_stats": step_stats(our_times), "trl_step_stats": step_stats(trainer_times),
            "xgblora_steps_per_s": len(our_times) / our_s, "trl_steps_per_s": len(trainer_times) / trainer_s,
            "speedup_vs_trl": trainer_s / our_s,
            "speedup_vs_trl_median_step": statistics.median(t / o for t, o in zip(trainer_times, our_times,
                                                                                   strict=True))}


def log_overhead(step_s: float, n: int = 500) -> dict[str, float]:
    """Mean cost of one MetricsLog.log (the train loop's per-step record, default buffering) over a step's time."""
    with tempfile.TemporaryDirectory() as tmp, MetricsLog(Path(tmp) / "metrics.jsonl") as metrics:
        loss = torch.tensor(1.2345)
        start = time.perf_counter()
        for step in range(1, n + 1):
            metrics.log({"step": step, "loss": float(loss), "lr": 1e-4, "elapsed_s": round(step * 0.1, 3)})
        per_log = (time.perf_counter() - start) / n
    return {"log_s_per_record": per_log, "log_overhead_fraction": per_log / step_s}
