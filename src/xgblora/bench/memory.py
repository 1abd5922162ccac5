"""Peak memory of each workload, measured in a fresh subprocess per workload.

On the CPU the figure is the peak RSS sampled while the workload runs: the process-lifetime peak (ru_maxrss) is
reached while the model is built. RSS counts everything the process imported, so this module (what a worker
imports) leaves out the HF Trainer + PEFT baseline; on CUDA the figure is max_memory_allocated.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from xgblora.bench.timing import sync_device
from xgblora.bench.workloads import Bench
from xgblora.models.pretrained import choose_device
from xgblora.perf import peak_memory_mb

MEMORY_WORKLOADS = ("inference", "zo", "zo_full", "adamw")
_ARG_KEYS = ("model_name", "batch_size", "seq_len", "target_len", "repeats", "warmup", "dtype", "device",
             "eval_examples")
_WORKER_CODE = ("import json,sys; from xgblora.bench.memory import memory_worker; "
                "print(json.dumps(memory_worker(json.loads(sys.argv[1]))))")


def _rss_mb() -> float:
    """Current resident set size of this process (Linux /proc), MiB."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssSampler(threading.Thread):
    """Samples the current RSS every `interval` seconds until stopped; `.peak_mb` is the largest sample.

    The process-lifetime peak (ru_maxrss) is useless for comparing workloads on the CPU: building the model
    peaks higher than any workload. Sampling while the workload runs measures the workload alone.
    """

    def __init__(self, interval: float = 5e-4) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak_mb, self._stop_event = interval, _rss_mb(), threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak_mb = max(self.peak_mb, _rss_mb())
            time.sleep(self.interval)

    def stop(self) -> float:
        """Stop sampling and return the peak (MiB)."""
        self._stop_event.set()
        self.join()
        self.peak_mb = max(self.peak_mb, _rss_mb())
        return self.peak_mb


def added_peak_mb(fn: Callable[[], Any], device: torch.device) -> float:
    """Memory (MiB) one call of fn adds to what the process held before it: max_memory_allocated on CUDA, the peak
    RSS sampled during the call on the CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    sampler = RssSampler()
    before = sampler.peak_mb
    sampler.start()
    fn()
    return sampler.stop() - before


def memory_worker(config: dict[str, Any]) -> dict[str, float]:
    """In a fresh process: set up one workload, run it a few times, and report its peak memory (MiB)."""
    args = argparse.Namespace(**config["args"])
    kind = config["kind"]
    bench = Bench(args, with_lora=kind in ("zo", "adamw"), with_plain=kind in ("inference", "zo_full"))
    batch = bench.next_batch()
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
    setup_mb = peak_memory_mb(bench.device)
    fn = {"inference": bench.forward, "zo": bench.zo_step, "zo_full": bench.zo_full_step,
          "adamw": bench.adamw_step}[kind]
    gc.collect()
    sampler = RssSampler() if bench.device.type == "cpu" else None
    if sampler is not None:
        sampler.start()
    for _ in range(3):
        fn(batch)
    sync_device(bench.device)
    peak = sampler.stop() if sampler is not None else peak_memory_mb(bench.device)
    return {"peak_mb": peak, "setup_peak_mb": setup_mb}


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Peak memory of each workload, each in its own subprocess (run concurrently; peaks are per process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = {}
    for kind in MEMORY_WORKLOADS[:2] if args.quick else MEMORY_WORKLOADS:  # --quick: just the ratio's two
        config = json.dumps({"kind": kind, "args": {k: v for k, v in vars(args).items() if k in _ARG_KEYS}})
        procs[kind] = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, config], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env)
    out: dict[str, Any] = {}
    for kind, proc in procs.items():
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"memory worker {kind!r} failed:\n{stderr[-2000:]}")
        result = json.loads(stdout.strip().splitlines()[-1])
        out[f"peak_mem_{kind}_mb"] = result["peak_mb"]
        out[f"setup_mem_{kind}_mb"] = result["setup_peak_mb"]
    out["zo_peak_mem_over_inference"] = out["peak_mem_zo_mb"] / out["peak_mem_inference_mb"]
    for kind in ("zo_full", "adamw"):
        if f"peak_mem_{kind}_mb" in out:
            out[f"{kind}_peak_mem_over_inference"] = out[f"peak_mem_{kind}_mb"] / out["peak_mem_inference_mb"]
    out["memory_kind"] = "cuda max_memory_allocated" if choose_device(args.device).type == "cuda" \
        else "peak RSS sampled while the workload runs (model set-up excluded)"
    return out


@contextlib.contextmanager
def peak_added(device: torch.device) -> Iterator[dict[str, float]]:
    """What the block adds to the memory held before it, MiB: {'before', 'peak', 'added'}."""
    out: dict[str, float] = {}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        out["before"] = torch.cuda.memory_allocated(device) / 2**20
        yield out
        sync_device(device)
        out["peak"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        sampler = RssSampler()
        out["before"] = _rss_mb()
        sampler.start()
        yield out
        out["peak"] = sampler.stop()
    out["added"] = out["peak"] - out["before"]


def first_steps_memory(side: str, ours: Callable[[], Any], baseline: Callable[[], Any], steps: int,
                       device: torch.device) -> dict[str, float]:
    """The memory one side's first steps add (MiB): `steps` train_step() calls of xgblora's Trainer, or the baseline
    trainer's train() (its own max_steps); each side built inside, so its set-up is not counted."""
    if side == "xgblora":
        trainer = ours()
        with peak_added(trainer.run.device) as mem:
            for _ in range(steps):
                trainer.train_step()
        return mem
    theirs = baseline()
    with peak_added(device) as mem:
        theirs.train()
    return mem


def sides_in_subprocesses(module: str, case: dict[str, Any], what: str, baseline: str = "trl") -> dict[str, Any]:
    """The memory each side (the baseline library, then xgblora) adds in a fresh process of its own: `module`'s
    memory_worker({"case": case, "side": side}) -> {'before', 'peak', 'added'} MiB; and xgblora's over the
    baseline's (keys `{side}_mem_*_mb`, `mem_added_over_{baseline}`)."""
    code = (f"import json,sys; from {module} import memory_worker; "
            f"print(json.dumps(memory_worker(json.loads(sys.argv[1]))))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out: dict[str, Any] = {}
    for side in (baseline, "xgblora"):
        proc = subprocess.run([sys.executable, "-c", code, json.dumps({"case": case, "side": side})],
                              capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{what} memory worker ({side}) failed:\n{proc.stderr[-2000:]}")
        mem = json.loads(proc.stdout.strip().splitlines()[-1])
        out.update({f"{side}_mem_{k}_mb": v for k, v in mem.items()})
    out[f"mem_added_over_{baseline}"] = out["xgblora_mem_added_mb"] / out[f"{baseline}_mem_added_mb"]
    return out


def memory_cell(result: dict[str, Any], baseline: str = "trl") -> str:
    """A table cell 'xgblora / baseline' of the MiB each side's steps added, or 'skipped' when not measured."""
    key = f"{baseline}_mem_added_mb"
    return f"{result['xgblora_mem_added_mb']:.0f} / {result[key]:.0f}" if key in result else "skipped"


def run_against_baseline(tag: str, cases: Iterable[Any], compare_case: Callable[[Any], dict[str, Any]],
                         case_memory: Callable[[Any], dict[str, Any]], table: Callable[[list[dict[str, Any]]], str],
                         skip_memory: bool) -> list[dict[str, Any]]:
    """Every case of a suite against the library users would otherwise pick (TRL, sentence-transformers): timing
    interleaved in this process (compare_case), then each side's memory in subprocesses (case_memory) unless
    skip_memory; each case's table row printed as it lands."""
    results = []
    for case in cases:
        res = compare_case(case)
        if not skip_memory:
            res.update(case_memory(case))
        results.append(res)
        print(f"[{tag}] {table([res]).splitlines()[-1]}", file=sys.stderr, flush=True)  # partial results
    return results
