"""The train suite of `xgblora bench`: every training-step, evaluation and memory figure as one flat dict (`run`),
printed by `bench.table.format_table`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

import torch

from xgblora.bench import flops
from xgblora.bench.baselines import eval_comparison, hf_vs_xgblora
from xgblora.bench.flags import apply_quick
from xgblora.bench.machine import machine_record
from xgblora.bench.memory import measure_memory
from xgblora.bench.profile import profile_slowest
from xgblora.bench.timing import log_overhead, median, step_stats, time_interleaved
from xgblora.bench.workloads import Bench

# model FLOPs of each workload per token of its batch: (kind of pass, passes); MeZO's perturbation sweeps and
# AdamW's update are not model FLOPs
WORKLOAD_FLOPS = {"forward": ("forward", 1), "two_forwards": ("forward", 2), "lora_forward": ("forward", 1),
                  "zo_step": ("forward", 2), "adamw_lora_step": ("train_lora", 1), "zo_full_step": ("forward", 2),
                  "hf_peft_step": ("train_lora", 1), "fo_lora_step_interleaved": ("train_lora", 1)}
PROFILED = ("zo_step", "adamw_lora_step", "zo_full_step")  # xgblora's own steps


def _sizes_and_environment(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    """The run's sizes, the machine, the library versions and the date."""
    return {
        **machine_record(args), "model_name": args.model_name, "seq_len": args.seq_len, "target_len": bench.n_target,
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
    res["step_stats"] = efficiency(bench, times)
    workloads = {"zo_step": bench.zo_step, "adamw_lora_step": bench.adamw_step, "zo_full_step": bench.zo_full_step}
    res["profiles"] = {name: profile_slowest(times[name], lambda _, fn=workloads[name]: fn(batch), bench.device)
                       for name in PROFILED}
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


def efficiency(bench: Bench, times: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Each workload's step statistics, tokens/s of its mean step and MFU (`bench.flops`: the device's bf16 peak;
    None on the CPU)."""
    args = bench.args
    tokens = args.batch_size * args.seq_len
    config = (bench.plain if bench.plain is not None else bench.lora_model).config
    out = {}
    for name, ts in times.items():
        stats = step_stats(ts)
        kind, passes = WORKLOAD_FLOPS[name]
        per_token = passes * flops.flops_per_token(config, args.seq_len, kind, bench.lora_report.trainable_params)
        tokens_per_s = tokens / stats["mean_s"] if ts else None
        out[name] = {**stats, "tokens_per_s": tokens_per_s, "flops_per_token": per_token,
                     "mfu": flops.mfu(tokens_per_s, per_token, bench.device) if ts else None}
    return out


def _hf_figures(bench: Bench) -> dict[str, Any]:
    """The HF Trainer + PEFT comparison, or a note saying why it was skipped (--skip_hf, or no peft)."""
    args = bench.args
    if args.skip_hf:
        return {"fo_lora_speedup_vs_hf_peft": None, "hf_note": "skipped (--skip_hf)"}
    if importlib.util.find_spec("peft") is None:
        return {"fo_lora_speedup_vs_hf_peft": None, "hf_note": "skipped: peft is not installed (pip install peft)"}
    res = hf_vs_xgblora(bench, max(args.repeats, 3), max(args.warmup, 1))
    res["step_stats"] = efficiency(bench, res.pop("step_times_s"))
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of the benchmark, as one flat dict of figures plus the run's sizes and environment."""
    apply_quick(args)
    torch.manual_seed(0)
    bench = Bench(args)
    res = _sizes_and_environment(args, bench)
    res.update(_step_figures(bench))
    res.update(log_overhead(res["adamw_lora_step_s"]))
    res.update(eval_comparison(bench, args.repeats, args.warmup))
    hf = _hf_figures(bench)
    res["step_stats"].update(hf.pop("step_stats", {}))
    res.update(hf)
    if args.skip_memory:
        res["zo_peak_mem_over_inference"] = None
    else:
        res.update(measure_memory(args))
    return res
