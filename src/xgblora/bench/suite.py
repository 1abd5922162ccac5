"""`xgblora bench` end to end: every measurement as one flat dict of figures (`run`), printed as a table (`main`)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from xgblora.bench.baselines import eval_comparison, hf_vs_xgblora
from xgblora.bench.flags import apply_quick
from xgblora.bench.memory import measure_memory
from xgblora.bench.table import format_table
from xgblora.bench.timing import log_overhead, median, time_interleaved
from xgblora.bench.workloads import Bench
from xgblora.models import choose_device


def _versions() -> dict[str, str | None]:
    """Versions of Python and of the libraries whose speed is measured."""
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                       "transformers": transformers.__version__}
    for pkg in ("peft", "accelerate", "trl"):
        if importlib.util.find_spec(pkg) is not None:
            versions[pkg] = __import__(pkg).__version__
    return versions


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """The machine, the library versions, the date and the common sizes of a run."""
    device = choose_device(args.device)
    return {
        "batch_size": args.batch_size, "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup,
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "versions": _versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _sizes_and_environment(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    """The run's sizes, the machine, the library versions and the date."""
    return {
        **environment(args), "model_name": args.model_name, "seq_len": args.seq_len, "target_len": bench.n_target,
        "total_params": sum(p.numel() for p in bench.plain.parameters()),
        "lora_trainable_params": bench.lora_report.trainable_params,
    }


def _step_figures(bench: Bench) -> dict[str, Any]:
    """Forwards and training steps on one batch, interleaved: median seconds, raw times, ratios and throughputs."""
    args = bench.args
    batch = bench.next_batch()
    times = time_interleaved({
        "forward": lambda: bench.forward(batch),
        "two_forwards": lambda: (bench.forward(batch), bench.forward(batch)),
        "lora_forward": lambda: bench.lora_forward(batch),
        "zo_step": lambda: bench.zo_step(batch),
        "adamw_lora_step": lambda: bench.adamw_step(batch),
        "zo_full_step": lambda: bench.zo_full_step(batch),
    }, args.repeats, args.warmup, bench.device)
    med = {name: median(ts) for name, ts in times.items()}
    tokens = args.batch_size * args.seq_len
    res: dict[str, Any] = {f"{name}_s": value for name, value in med.items()}
    res["raw_times_s"] = times
    res.update({
        "zo_step_over_two_forwards": med["zo_step"] / med["two_forwards"],
        "zo_full_step_over_two_forwards": med["zo_full_step"] / med["two_forwards"],
        "fo_lora_step_over_forward": med["adamw_lora_step"] / med["forward"],
        "lora_forward_over_forward": med["lora_forward"] / med["forward"],
        "two_forwards_over_forward": med["two_forwards"] / med["forward"],
        "forward_tokens_per_s": tokens / med["forward"],
        "zo_train_tokens_per_s": tokens / med["zo_step"], "zo_train_samples_per_s": args.batch_size / med["zo_step"],
        "zo_full_train_tokens_per_s": tokens / med["zo_full_step"],
        "zo_full_train_samples_per_s": args.batch_size / med["zo_full_step"],
        "fo_lora_train_tokens_per_s": tokens / med["adamw_lora_step"],
        "fo_lora_train_samples_per_s": args.batch_size / med["adamw_lora_step"],
    })
    return res


def _hf_figures(bench: Bench) -> dict[str, Any]:
    """The HF Trainer + PEFT comparison, or a note saying why it was skipped (--skip_hf, or no peft)."""
    args = bench.args
    if args.skip_hf:
        return {"fo_lora_speedup_vs_hf_peft": None, "hf_note": "skipped (--skip_hf)"}
    if importlib.util.find_spec("peft") is None:
        return {"fo_lora_speedup_vs_hf_peft": None, "hf_note": "skipped: peft is not installed (pip install peft)"}
    return hf_vs_xgblora(bench, max(args.repeats, 3), max(args.warmup, 1))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of the benchmark, as one flat dict of figures plus the run's sizes and environment."""
    apply_quick(args)
    torch.manual_seed(0)
    bench = Bench(args)
    res = _sizes_and_environment(args, bench)
    res.update(_step_figures(bench))
    res.update(log_overhead(res["adamw_lora_step_s"]))
    res.update(eval_comparison(bench, args.repeats, args.warmup))
    res.update(_hf_figures(bench))
    if args.skip_memory:
        res["zo_peak_mem_over_inference"] = None
    else:
        res.update(measure_memory(args))
    return res


# The other suites: module (with run(args) -> list of results and format_table) and the JSON key of the list
_SUITES = {"sft": ("xgblora.bench.sft", "cases"), "icl": ("xgblora.bench.icl", "tasks"),
           "compile": ("xgblora.bench.compile", "workloads")}


def _run_suite(args: argparse.Namespace) -> tuple[Any, str]:
    """The figures of the suite the flags name, and their printed table."""
    if args.suite == "train":
        res = run(args)
        return res, format_table(res)
    if args.suite == "gpu":
        from xgblora.bench import gpu

        args.json = args.json or "gpu-suite.json"
        report = gpu.run(args)
        return {"suite": "gpu", "environment": environment(args), **report}, gpu.format_table(report)
    module_name, key = _SUITES[args.suite]
    module = importlib.import_module(module_name)
    results = module.run(apply_quick(args))
    return {"suite": args.suite, "environment": environment(args), key: results}, module.format_table(results)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark suite, print its table, and write the JSON when --json is given."""
    with contextlib.redirect_stdout(sys.stderr):  # HF Trainer prints its summary; keep stdout for the table
        res, table = _run_suite(args)
    print(table, flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"wrote {path}")
        if args.suite != "train":  # the other suites' tables are Markdown: kept beside the JSON
            path.with_suffix(".md").write_text(table + "\n", encoding="utf-8")
            print(f"wrote {path.with_suffix('.md')}")
    return 0
