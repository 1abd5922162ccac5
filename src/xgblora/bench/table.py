"""The targets of the headline figures, their verdicts, and the table `xgblora bench` prints."""

from __future__ import annotations

import math
from typing import Any

# Targets: key -> (comparison, bound); "<=" means lower is better.
TARGETS: dict[str, tuple[str, float]] = {
    "zo_step_over_two_forwards": ("<=", 1.0),
    "zo_full_step_over_two_forwards": ("<=", 1.15),
    "fo_lora_speedup_vs_hf_peft": (">=", 1.5),
    "eval_speedup_vs_per_candidate": (">=", 5.0),
    "zo_peak_mem_over_inference": ("<=", 1.1),
}

# The table's rows: (figure's key, label, unit); "s" is shown in ms, "x" as a ratio.
_ROWS = [
    ("forward_s", "forward (plain model, no grad)", "s"),
    ("two_forwards_s", "two forwards", "s"),
    ("zo_step_s", "MeZO step, LoRA, dual batch", "s"),
    ("zo_full_step_s", "MeZO step, full model", "s"),
    ("adamw_lora_step_s", "AdamW LoRA step", "s"),
    ("zo_step_over_two_forwards", "MeZO LoRA step / two forwards", "x"),
    ("zo_full_step_over_two_forwards", "MeZO full step / two forwards", "x"),
    ("fo_lora_step_over_forward", "AdamW LoRA step / one forward", "x"),
    ("zo_train_tokens_per_s", "MeZO LoRA train tokens/s", ""),
    ("zo_train_samples_per_s", "MeZO LoRA train samples/s", ""),
    ("zo_full_train_tokens_per_s", "MeZO full train tokens/s", ""),
    ("fo_lora_train_tokens_per_s", "AdamW LoRA train tokens/s", ""),
    ("fo_lora_train_samples_per_s", "AdamW LoRA train samples/s", ""),
    ("fo_lora_step_interleaved_s", "AdamW LoRA step, alternating with HF", "s"),
    ("hf_peft_step_s", "HF Trainer+PEFT step, alternating", "s"),
    ("hf_peft_train_tokens_per_s", "HF Trainer+PEFT train tokens/s", ""),
    ("fo_lora_speedup_vs_hf_peft", "AdamW LoRA speed-up vs HF+PEFT", "x"),
    ("eval_examples_per_s", "eval examples/s (batched)", ""),
    ("eval_tokens_per_s", "eval tokens/s (batched)", ""),
    ("eval_no_cache_examples_per_s", "eval examples/s (batched, no cache)", ""),
    ("eval_per_candidate_examples_per_s", "eval examples/s (1 pair/forward)", ""),
    ("eval_speedup_vs_per_candidate", "eval speed-up vs 1 pair/forward", "x"),
    ("peak_mem_inference_mb", "peak memory, inference", "MiB"),
    ("peak_mem_zo_mb", "peak memory, MeZO LoRA", "MiB"),
    ("peak_mem_zo_full_mb", "peak memory, MeZO full", "MiB"),
    ("peak_mem_adamw_mb", "peak memory, AdamW LoRA", "MiB"),
    ("zo_peak_mem_over_inference", "MeZO LoRA peak mem / inference", "x"),
    ("zo_full_peak_mem_over_inference", "MeZO full peak mem / inference", "x"),
    ("log_overhead_fraction", "MetricsLog.log / AdamW step", "x"),
]


def _verdict(key: str, value: Any) -> tuple[str, str]:
    """The target column ("<= 1") and the result column (pass, miss, n/a; empty without a target)."""
    if key not in TARGETS:
        return "", ""
    op, bound = TARGETS[key]
    if not isinstance(value, float | int) or not math.isfinite(value):
        return f"{op} {bound:g}", "n/a"
    met = value <= bound if op == "<=" else value >= bound
    return f"{op} {bound:g}", "pass" if met else "miss"


def _shown(key: str, value: Any, unit: str) -> str:
    """The value column: the figure in its unit, or "skipped"."""
    if value is None:
        return "skipped"
    if unit == "s":
        return f"{value * 1000:.2f} ms"
    if unit == "x":
        return f"{value:.4g}x" if key != "log_overhead_fraction" else f"{value:.2e}"
    if unit == "MiB":
        return f"{value:.1f} MiB"
    return f"{value:,.1f}"


def format_table(res: dict[str, Any]) -> str:
    """One line per measurement: name, value, target, pass/miss."""
    head = (f"xgblora bench: {res['model_name']} ({res['total_params']:,} params), batch {res['batch_size']} x "
            f"{res['seq_len']} tokens ({res['target_len']} scored), {res['dtype']}, {res['device']} "
            f"({res['device_name']}, {res['cpu_threads']} threads), median of {res['repeats']} interleaved")
    lines = [head, f"{'measurement':<36} {'value':>14} {'target':>8}  result", "-" * 68]
    for key, label, unit in _ROWS:
        if key not in res:
            continue
        target, verdict = _verdict(key, res[key])
        lines.append(f"{label:<36} {_shown(key, res[key], unit):>14} {target:>8}  {verdict}")
    if res.get("hf_note"):
        lines.append(f"HF baseline: {res['hf_note']}")
    if "eval_source" in res:
        lines.append(f"eval workload: {res['eval_source']}, {res['eval_n_examples']} examples, prompts of "
                     f"{res['eval_mean_prompt_tokens']:.0f} tokens (max {res['eval_max_prompt_tokens']}), "
                     f"{res['eval_candidates_per_example']:.1f} candidates of {res['eval_mean_candidate_tokens']:.1f} "
                     f"tokens each, batch {res['batch_size']} prompts")
    return "\n".join(lines)
