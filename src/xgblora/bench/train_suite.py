"""The train suite of `xgblora bench`: every training-step, evaluation and memory figure as one flat dict (`run`),
printed by `bench.table.format_table`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

import torch

from xgblora.bench.baselines import eval_comparison, hf_vs_xgblora
from xgblora.bench.flags import apply_quick
from xgblora.bench.machine import environment
from xgblora.bench.memory import measure_memory
from xgblora.bench.timing import log_overhead, median, time_interleaved
from xgblora.bench.workloads import Bench


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
