"""Where a step's time went: the slowest timed step of a workload run again under torch.profiler, its top ops.

The timed steps run without the profiler (it slows every op); the slowest one's inputs then run once more under
it. A cost paid only the first time a shape is met (a kernel plan, an allocator growth) does not come back in the
replay, so the summary keeps both times: the timed step's and the profiled replay's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from xgblora.bench.timing import sync_device


def _self_time_us(event: Any, cuda: bool) -> float:
    if not cuda:
        return event.self_cpu_time_total
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def profile_step(fn: Callable[[], Any], device: torch.device, top: int = 12) -> dict[str, Any]:
    """Run fn once under torch.profiler: its wall time and the `top` ops by self CUDA time (by self CPU time on the
    CPU), each with its calls, seconds and share of all ops' self time."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync_device(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync_device(device)
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if _self_time_us(e, cuda) > 0]
    total_us = sum(_self_time_us(e, cuda) for e in events)
    ranked = sorted(events, key=lambda e: _self_time_us(e, cuda), reverse=True)[:top]
    return {"sorted_by": "self CUDA time" if cuda else "self CPU time", "wall_s": wall, "total_self_s": total_us / 1e6,
            "ops": [{"name": e.key, "calls": e.count, "self_s": _self_time_us(e, cuda) / 1e6,
                     "share": _self_time_us(e, cuda) / total_us if total_us else 0.0} for e in ranked]}


def profile_slowest(step_s: list[float], replay: Callable[[int], Any], device: torch.device,
                    top: int = 12) -> dict[str, Any] | None:
    """The profile of the slowest timed step (index into step_s) run again by replay(index); None without steps."""
    if not step_s:
        return None
    index = max(range(len(step_s)), key=step_s.__getitem__)
    return {"step": index, "timed_s": step_s[index], **profile_step(lambda: replay(index), device, top)}


def format_profile(name: str, summary: dict[str, Any] | None, rows: int = 8) -> str:
    """A Markdown table of a profile's top ops."""
    if not summary:
        return ""
    lines = [f"{name}: step {summary['step']} timed {summary['timed_s']:.3f} s, replayed under the profiler "
             f"{summary['wall_s']:.3f} s; top ops by {summary['sorted_by']}", "",
             "| op | calls | self s | share |", "|---|---|---|---|"]
    lines += [f"| `{op['name']}` | {op['calls']} | {op['self_s']:.4f} | {op['share']:.0%} |"
              for op in summary["ops"][:rows]]
    return "\n".join(lines)
