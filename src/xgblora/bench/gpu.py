"""`xgblora bench --suite gpu`: everything to check and measure on a GPU machine, in one command, < 8 min.

Parts, in order of priority (each starts only while its time estimate fits in what is left of --gpu_budget_s;
the others are reported as skipped for time; --gpu_parts runs a chosen few):
    cuda_tests     the tests marked cuda in the file --cuda_tests names (a checkout's tests/test_cuda.py): bf16
                   autocast, SDPA / flash-attention selection, varlen packing (flash-attn), fused AdamW, --compile,
                   MeZO's dual batch, full-model MeZO in bf16, a real OOM halved, 1-GPU NCCL, no host sync in the loss
    bench:llama-1b-random  the train suite (MeZO/AdamW steps, evaluation, HF Trainer + PEFT, peak memory) at a
                   user's size: bf16, batch 16 x 256
    sft            the SFT suite against TRL (llama-100m-random, padded and packed), bf16, batch 16, 10 steps
    sft_128k       the padded case at Llama 3's 128k vocabulary (llama-100m-128k-random): the fused LM head's figure
    grpo           GRPO against TRL's GRPOTrainer + PEFT (llama-100m-random, 2 prompts x 8 completions of <= 32),
                   each library's gradient checkpointing default, then on both sides
    dpo            DPO against TRL's DPOTrainer + PEFT (llama-100m-128k-random, 8 pairs of 128 + 2 x 64 tokens)
    sft_liger      the padded case with Liger's kernels on both sides (--use_liger_kernel; TRL's use_liger_kernel)
    sft_shapes     xgblora's padded SFT steps, widths as they come (cuDNN attention on and off) and widened to a
                   multiple of 64, interleaved: where the slow padded steps come from
    embed          the contrastive step against sentence-transformers' trainer (bert-base-random, batch 64)
    icl            in-context evaluation, demonstrations cached once vs the per-pair loop (opt-1.3b-random)
    compile        --compile's warm-up and per-step gain (llama-1b-random, bf16, 16 x 256)
    bench:opt-1.3b-random  the train suite on OPT's shapes (runs when the budget leaves room, or with --gpu_parts)
Every comparison records each side's steps (mean, median, p90, max, the list) and MFU (`bench.flops`), and each
xgblora workload the profile of its slowest timed step (`bench.profile`). Random models are built on the GPU in
bf16; nothing is downloaded. On a machine without CUDA the same command runs its CPU part (the cuda tests, which
skip with the reason, and the train suite at CI size) and lists every part that needs CUDA with its estimate.
Writes --json FILE (default gpu-suite.json) and a Markdown table beside it (FILE with .md), after every part.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xgblora.bench import compile as compile_suite
from xgblora.bench import dpo, embed, es, grpo, icl, sft, train_suite
from xgblora.bench.profile import format_profile
from xgblora.bench.timing import step_stats

USER_MODELS = ("llama-1b-random", "opt-1.3b-random")
# Seconds each part is expected to take on an H100 (model set-up and the memory subprocesses included); a part
# starts only if its estimate fits in what is left of the budget
ESTIMATE_S = {"cuda_tests": 45, "bench": 90, "sft": 90, "sft_128k": 40, "sft_liger": 45, "sft_shapes": 30,
              "grpo": 110, "dpo": 40, "es": 45, "embed": 45, "icl": 50, "compile": 90}


def cuda_tests(budget_s: float, path: str = "tests/test_cuda.py") -> dict[str, Any]:
    """Run the tests marked cuda in `path` in a subprocess; each test's outcome (passed, failed, skipped) and
    message."""
    tests = Path(path)
    if not tests.is_file():
        return {"status": "not run", "note": f"{tests} not found: run from a checkout, or pass --cuda_tests PATH"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(tests),
                   f"--junitxml={report}"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=budget_s, check=False)
        except subprocess.TimeoutExpired as exc:  # a hung CUDA call must not cost the rest of the suite
            output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return {"status": f"failed: timed out after {budget_s:.0f} s", "output_tail": output[-3000:]}
        outcomes_by_test = _junit_outcomes(report) if report.is_file() else {}
    outcomes = [t["outcome"] for t in outcomes_by_test.values()]
    return {"status": "failed" if "failed" in outcomes or proc.returncode not in (0, 5) else "ran",
            "passed": outcomes.count("passed"), "failed": outcomes.count("failed"),
            "skipped": outcomes.count("skipped"), "tests": outcomes_by_test, "output_tail": proc.stdout[-3000:]}


def _junit_outcomes(path: Path) -> dict[str, dict[str, str]]:
    """test name -> {outcome, message} from a pytest JUnit XML report."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (node.get("message") or "")[:300]
        out[case.get("name")] = {"outcome": outcome, "message": message}
    return out


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    new = copy.copy(args)
    for key, value in changes.items():
        setattr(new, key, value)
    return new


def _user_sizes(args: argparse.Namespace, model: str) -> argparse.Namespace:
    return _with(args, model_name=model, dtype="bfloat16", batch_size=16, seq_len=256, repeats=5, warmup=2,
                 eval_examples=64, quick=False, skip_hf=False, skip_memory=False)


def _sft_case(args: argparse.Namespace) -> sft.SFTCase:
    return sft.SFTCase(model_name="llama-100m-random", packed=False, checkpointing=False, batch_size=16, steps=10,
                       warmup=2, dtype="bfloat16", device=args.device, data_dir=args.data_dir or "")


def cuda_parts(args: argparse.Namespace) -> list[tuple[str, str, Callable[[], Any]]]:
    """(name, estimate key, run) of every part that needs CUDA, in order of priority."""
    first, *others = USER_MODELS
    sized = _with(args, dtype="bfloat16", quick=False, skip_memory=False)
    return [
        (f"bench:{first}", "bench", lambda: train_suite.run(_user_sizes(args, first))),
        ("sft", "sft", lambda: sft.run(_with(sized, sft_models=["llama-100m-random"], sft_variants=["padded", "packed"],
                                             batch_size=16, repeats=10, warmup=2))),
        ("sft_128k", "sft_128k", lambda: sft.run(_with(sized, sft_models=["llama-100m-128k-random"],
                                                       sft_variants=["padded"], batch_size=16, repeats=5, warmup=2))),
        ("grpo", "grpo", lambda: grpo.run(_with(sized, grpo_models=["llama-100m-random"], grpo_prompts=2,
                                                num_generations=8, max_completion_length=32, repeats=3, warmup=1,
                                                checkpointing=["default", "on"]))),
        ("dpo", "dpo", lambda: dpo.run(_with(sized, dpo_models=["llama-100m-128k-random"], batch_size=8,
                                             dpo_prompt_len=128, dpo_completion_len=64, repeats=3, warmup=1))),
        ("es", "es", lambda: es.run(_with(sized, grpo_models=["llama-100m-random"], grpo_prompts=8, num_generations=1,
                                          max_completion_length=32, es_population=8, es_member_batch=8, repeats=3,
                                          warmup=1))),
        ("sft_liger", "sft_liger", lambda: sft.run(_with(sized, sft_models=["llama-100m-random"],
                                                         sft_variants=["padded+liger"], batch_size=16, repeats=5,
                                                         warmup=2))),
        ("sft_shapes", "sft_shapes", lambda: sft.shape_case(_sft_case(args))),
        ("embed", "embed", lambda: embed.run(_with(sized, embed_model="bert-base-random", embed_batches=[64],
                                                   embed_pairs=["multirc"], embed_max_length=256, repeats=5,
                                                   warmup=2))),
        ("icl", "icl", lambda: icl.run(_with(sized, model_name="opt-1.3b-random", eval_examples=32, batch_size=16,
                                             repeats=2, warmup=1, icl_context=0))),
        ("compile", "compile", lambda: compile_suite.run(_with(_user_sizes(args, first), repeats=3))),
        *((f"bench:{m}", "bench", lambda m=m: train_suite.run(_user_sizes(args, m))) for m in others),
    ]


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] = lambda report: None) -> dict[str, Any]:
    """Every part that fits the time budget; the CPU part only where there is no CUDA device. `save(report)` after
    each part, so that a run stopped from outside keeps what it measured."""
    start = time.monotonic()
    left = lambda: args.gpu_budget_s - (time.monotonic() - start)  # noqa: E731
    cuda = torch.cuda.is_available() and args.device != "cpu"
    report: dict[str, Any] = {"cuda": cuda, "parts": {}, "elapsed_s": 0.0}
    parts = report["parts"]
    if "cuda_tests" in args.gpu_parts:
        # a hung CUDA call may take a few times the estimate, not the whole budget
        parts["cuda_tests"] = cuda_tests(max(60.0, min(left(), 3 * ESTIMATE_S["cuda_tests"])), args.cuda_tests)
        save(report)
    if not cuda:
        parts["cpu_bench"] = train_suite.run(_with(args, model_name="tiny-opt", quick=True, skip_hf=True,
                                                   skip_memory=True, device="cpu"))
        for name, key, _ in cuda_parts(args):
            if key in args.gpu_parts:
                parts[name] = {"status": "needs CUDA", "estimate_s": ESTIMATE_S[key]}
        report["elapsed_s"] = time.monotonic() - start
        return report
    for name, key, fn in cuda_parts(_with(args, device="cuda")):
        if key not in args.gpu_parts:
            continue
        if left() < ESTIMATE_S[key]:
            parts[name] = {"status": f"skipped: {left():.0f} s left of --gpu_budget_s, needs about {ESTIMATE_S[key]}",
                           "estimate_s": ESTIMATE_S[key]}
            continue
        t0 = time.monotonic()
        try:
            parts[name] = {"status": "ran", "results": fn()}
        except Exception as exc:  # noqa: BLE001 -- one broken part must not cost the figures of the others
            parts[name] = {"status": f"failed: {type(exc).__name__}: {str(exc)[:500]}"}
        parts[name].update(seconds=time.monotonic() - t0, estimate_s=ESTIMATE_S[key])
        report["elapsed_s"] = time.monotonic() - start
        save(report)
        print(f"[gpu] {name}: {parts[name]['status']} ({parts[name]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    report["elapsed_s"] = time.monotonic() - start
    return report


def write(path: Path, report: dict[str, Any]) -> None:
    """The report as JSON at path and its tables as Markdown beside it (path with .md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    path.with_suffix(".md").write_text(format_table(report) + "\n", encoding="utf-8")


def _summary(name: str, part: dict[str, Any]) -> str:
    """One cell of figures for a part that ran."""
    res = part.get("results")
    if name == "cuda_tests":
        return f"{part.get('passed', 0)} passed, {part.get('failed', 0)} failed, {part.get('skipped', 0)} skipped"
    if name.startswith("bench:") or name == "cpu_bench":
        res = res if res is not None else part
        keys = ("zo_step_over_two_forwards", "zo_full_step_over_two_forwards", "fo_lora_speedup_vs_hf_peft",
                "eval_speedup_vs_per_candidate", "zo_peak_mem_over_inference")
        return ", ".join(f"{k} {res[k]:.3g}" for k in keys if isinstance(res.get(k), float))
    if not res:
        return ""
    if name in ("sft", "sft_128k", "sft_liger"):
        return "; ".join(f"{r['variant']} {r['speedup_vs_trl']:.2f}x TRL" for r in res)
    if name == "sft_shapes":
        return "; ".join(f"{label}: mean {v['mean_s']:.3f} s, max {v['max_s']:.3f} s"
                         for label, v in res["sides"].items())
    if name in ("grpo", "dpo"):
        return "; ".join(f"{r['model_name']} {r['speedup_vs_trl']:.2f}x TRL's steps/s" for r in res)
    if name == "embed":
        return "; ".join(f"{r['variant']} {r['speedup_vs_st']:.2f}x sentence-transformers" for r in res)
    if name == "es":
        return "; ".join(f"{r['model_name']} {r['speedup']:.2f}x, {r['member_batch']} members per generation"
                         for r in res)
    if name == "icl":
        return "; ".join(f"{r['task']} {r['speedup_vs_per_pair']:.1f}x per pair" for r in res)
    if name == "compile":
        return "; ".join(f"{r['workload']} {r['compiled_speedup']:.2f}x, warm-up +{r['warmup_extra_s']:.0f} s"
                         for r in res)
    return ""


def _sides(name: str, res: Any) -> list[tuple[str, dict[str, Any], float | None]]:
    """(workload or side, step statistics, MFU) of every timed side of a part's results."""
    if name.startswith("bench:") or name == "cpu_bench":
        return [(w, st, st.get("mfu")) for w, st in res.get("step_stats", {}).items()]
    if name == "sft_shapes":
        return [(f"padded widths {label}", st, None) for label, st in res["sides"].items()]
    if name == "compile":
        return [(f"{r['workload']} {side}", step_stats(r["raw_times_s"][side]), None)
                for r in res for side in ("eager", "compiled")]
    if name == "es":
        return [(f"{r['model_name']} {side}", r[f"{side}_step_stats"], None)
                for r in res for side in ("one", "batched")]
    baseline = {"sft": "trl", "sft_128k": "trl", "sft_liger": "trl", "grpo": "trl", "dpo": "trl",
                "embed": "st"}.get(name)
    if baseline is None:
        return []
    return [(f"{r.get('variant', r['model_name'])} {side}", r[f"{side}_step_stats"], r.get(f"{side}_mfu"))
            for r in res for side in ("xgblora", baseline)]


def _profiles(name: str, res: Any) -> list[tuple[str, dict[str, Any] | None]]:
    if name.startswith("bench:") or name == "cpu_bench":
        return [(f"{name} {w}", p) for w, p in res.get("profiles", {}).items()]
    if name in ("sft", "sft_128k", "sft_liger", "grpo", "dpo", "embed"):
        return [(f"{name} {r.get('variant', r['model_name'])}", r.get("xgblora_profile")) for r in res]
    return []


def _step_table(report: dict[str, Any]) -> list[str]:
    lines = ["", "| part | side | mean s | median s | p90 s | max s | MFU | every step (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, part in report["parts"].items():
        res = part.get("results", part if name == "cpu_bench" else None)
        for side, st, mfu in _sides(name, res) if res else []:
            if not st.get("n"):
                continue
            every = " ".join(f"{t:.3g}" for t in st["steps_s"])
            lines.append(f"| {name} | {side} | {st['mean_s']:.4g} | {st['median_s']:.4g} | {st['p90_s']:.4g} | "
                         f"{st['max_s']:.4g} | {f'{mfu:.1%}' if mfu is not None else 'n/a'} | {every} |")
    return lines


def format_table(report: dict[str, Any]) -> str:
    """Markdown: the parts (status, seconds, headline figures), every side's steps with MFU, the outcome of every
    cuda test, and the top ops of each xgblora workload's slowest step."""
    lines = [f"GPU suite ({'CUDA' if report['cuda'] else 'no CUDA: CPU part only'}), {report['elapsed_s']:.0f} s",
             "", "| part | status | s (estimate) | figures |", "|---|---|---|---|"]
    for name, part in report["parts"].items():
        status = "ran" if name == "cpu_bench" else part.get("status", "")
        took = f"{part['seconds']:.0f} " if "seconds" in part else ""
        estimate = f"({part['estimate_s']})" if "estimate_s" in part else ""
        lines.append(f"| {name} | {status} | {took}{estimate} | {_summary(name, part)} |")
    lines += _step_table(report)
    tests = report["parts"].get("cuda_tests", {}).get("tests", {})
    if tests:
        lines += ["", "| cuda test | outcome | message |", "|---|---|---|"]
        lines += [f"| {n} | {t['outcome']} | {t['message']} |" for n, t in tests.items()]
    for name, part in report["parts"].items():
        res = part.get("results", part if name == "cpu_bench" else None)
        for label, summary in _profiles(name, res) if res else []:
            if summary:
                lines += ["", format_profile(label, summary)]
    return "\n".join(lines)
