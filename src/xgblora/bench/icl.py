"""`xgblora bench --suite icl`: in-context evaluation (MeZO's ICL setting) with the demonstrations cached once,
against the per-pair loop and the batched whole-pair path.

For each task (RTE, SST-2 by default): k demonstrations drawn from the train split (seed 0; k = --icl_demos, 32 by
default, lowered until demonstrations + the longest example fit the model's context), the first --eval_examples dev
rows scored by `evaluate.candidate_scores` (demonstrations run once, each prompt once, candidates against its cache),
by the same with prefix_cache=False (every pair whole, batched) and by `baselines.per_candidate_scores` (one forward
per pair), interleaved. The predictions of the three are compared, and the largest score difference reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from typing import Any

import torch

from xgblora.bench.baselines import per_candidate_scores
from xgblora.bench.timing import median, time_interleaved
from xgblora.bench.workloads import synthetic_examples
from xgblora.data.collation import demonstration_text
from xgblora.data.splits import load_rows
from xgblora.data.tasks import Example, get_task
from xgblora.evaluation.candidates import candidate_scores
from xgblora.models import pretrained

ICL_TASKS = ("RTE", "SST2")


def fitting_demos(tokenizer: Any, pool: list[Example], examples: list[Example], k: int, context: int,
                  seed: int = 0) -> list[Example]:
    """k demonstrations sampled from pool, fewer when they and the longest example would not fit the context."""
    demos = random.Random(seed).sample(pool, min(k, len(pool)))
    longest = max(len(tokenizer(ex.prompt + c)["input_ids"]) for ex in examples for c in ex.candidates)
    while demos and len(tokenizer(demonstration_text(demos))["input_ids"]) + longest > context:
        demos.pop()
    return demos


def task_workload(args: argparse.Namespace, task_name: str) -> tuple[list[Example], list[Example], str]:
    """(train pool, dev examples, source) of a task, or synthetic RTE-shaped ones without --data_dir."""
    if args.data_dir is None:
        pool = synthetic_examples(64, seed=1)
        return pool, synthetic_examples(args.eval_examples), "synthetic RTE-shaped"
    task = get_task(task_name)
    return (load_rows(task, "train", args.data_dir), load_rows(task, "eval", args.data_dir)[:args.eval_examples],
            f"{task.name} rows from {args.data_dir}")


def _argmax(rows: list[list[float]]) -> list[int]:
    return [max(range(len(r)), key=r.__getitem__) for r in rows]


def compare_task(model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace, task_name: str) -> dict[str, Any]:
    """The three scorers on one task's ICL workload, interleaved; times, speed-ups, agreement."""
    pool, examples, source = task_workload(args, task_name)
    context = args.icl_context or int(getattr(model.config, "max_position_embeddings", 2048))
    demos = fitting_demos(tokenizer, pool, examples, args.icl_demos, context)
    prefix = demonstration_text(demos)
    with_demos = [dataclasses.replace(ex, prompt=prefix + ex.prompt) for ex in examples]
    results: dict[str, list[list[float]]] = {}

    def keep(name, fn):
        return lambda: results.__setitem__(name, fn())

    times = time_interleaved({
        "cached": keep("cached", lambda: candidate_scores(model, tokenizer, examples, demos=demos,
                                                           batch_size=args.batch_size, max_length=context)),
        "no_cache": keep("no_cache", lambda: candidate_scores(model, tokenizer, examples, demos=demos,
                                                               batch_size=args.batch_size, max_length=context,
                                                               prefix_cache=False)),
        "per_pair": keep("per_pair", lambda: per_candidate_scores(model, tokenizer, with_demos)),
    }, args.repeats, args.warmup, next(model.parameters()).device)
    cached, no_cache, per_pair = (median(times[k]) for k in ("cached", "no_cache", "per_pair"))
    diff = max(abs(a - b) for ra, rb in zip(results["cached"], results["per_pair"], strict=True)
               for a, b in zip(ra, rb, strict=True))
    return {
        "task": task_name, "source": source, "n_examples": len(examples), "n_demos": len(demos),
        "demo_tokens": len(tokenizer(prefix)["input_ids"]),
        "mean_prompt_tokens": statistics.mean(len(tokenizer(ex.prompt)["input_ids"]) for ex in examples),
        "candidates_per_example": statistics.mean(len(ex.candidates) for ex in examples),
        "cached_s": cached, "no_cache_s": no_cache, "per_pair_s": per_pair, "raw_times_s": times,
        "speedup_vs_per_pair": per_pair / cached, "speedup_vs_no_cache": no_cache / cached,
        "predictions_identical": _argmax(results["cached"]) == _argmax(results["per_pair"])
        == _argmax(results["no_cache"]),
        "max_abs_score_diff_vs_per_pair": diff,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every task of the ICL comparison on one model."""
    model, tokenizer = pretrained.load(args.model_name, dtype=args.dtype, device=args.device,
                                       build_on_device=True)
    model.eval()
    out = []
    for task_name in args.icl_tasks or ICL_TASKS:
        res = compare_task(model, tokenizer, args, task_name)
        out.append({"model_name": args.model_name, **res})
    return out


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per task, with the 5x target's verdict."""
    lines = ["| model | task | examples | demos (tokens) | prompt tokens | cached / whole batched / per pair (s) | "
             "speed-up vs per pair | vs whole batched | same predictions (max score diff) | >= 5x |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['model_name']} | {r['task']} | {r['n_examples']} | {r['n_demos']} ({r['demo_tokens']}) | "
            f"{r['mean_prompt_tokens']:.0f} | {r['cached_s']:.2f} / {r['no_cache_s']:.2f} / {r['per_pair_s']:.2f} | "
            f"{r['speedup_vs_per_pair']:.2f}x | {r['speedup_vs_no_cache']:.2f}x | "
            f"{'yes' if r['predictions_identical'] else 'NO'} ({r['max_abs_score_diff_vs_per_pair']:.1e}) | "
            f"{'pass' if r['speedup_vs_per_pair'] >= 5 else 'miss'} |")
    return "\n".join(lines)
