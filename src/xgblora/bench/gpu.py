"""`xgblora bench --suite gpu`: everything to check and measure on a GPU machine, in one command, < 10 min.

Parts, in order of priority (each starts only while its time estimate fits in what is left of --gpu_budget_s;
the others are reported as skipped for time; --gpu_parts runs a chosen few):
    cuda_tests     `pytest -m cuda tests/test_cuda.py`: bf16 autocast, SDPA / flash-attention selection, varlen
                   packing (flash-attn), fused AdamW, --compile, MeZO's dual batch, full-model MeZO in bf16,
                   a real OOM halved, 1-GPU NCCL
    bench:llama-1b-random  the train suite (MeZO/AdamW steps, evaluation, HF Trainer + PEFT, peak memory) at a
                   user's size: bf16, batch 16 x 256
    sft            the SFT suite against TRL (llama-100m-random, padded and packed), bf16, batch 16
    icl            in-context evaluation, demonstrations cached once vs the per-pair loop (opt-1.3b-random)
    compile        --compile's warm-up and per-step gain (llama-1b-random, bf16, 16 x 256)
    bench:opt-1.3b-random  the train suite on OPT's shapes (runs with --gpu_budget_s 900)
On a machine without CUDA the same command runs its CPU part: the cuda tests (which skip, with the reason) and the
train suite at CI size, and lists the parts that need CUDA. Nothing is downloaded: every model is a built-in random
one. Writes --json FILE (default gpu-suite.json) and a Markdown table beside it (FILE with .md).
"""

from __future__ import annotations

import argparse
import copy
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
from xgblora.bench import icl, sft, train_suite

USER_MODELS = ("llama-1b-random", "opt-1.3b-random")
# Seconds each part took on an H200 (model set-up included; most of a bench part is building the random 1B
# model on the CPU for each of its processes); compile's is a guess. A part starts only if it fits
ESTIMATE_S = {"cuda_tests": 60, "bench": 250, "sft": 100, "icl": 80, "compile": 120}
TESTS = Path(__file__).resolve().parents[3] / "tests" / "test_cuda.py"


def cuda_tests(budget_s: float) -> dict[str, Any]:
    """Run the tests marked cuda in a subprocess; each test's outcome (passed, failed, skipped) and message."""
    if not TESTS.is_file():
        return {"status": "not run", "note": f"{TESTS} not found: run from a checkout of the repository"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(TESTS),
                   f"--junitxml={report}"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=budget_s, check=False)
        except subprocess.TimeoutExpired as exc:  # a hung CUDA call must not cost the rest of the suite
            output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return {"status": f"failed: timed out after {budget_s:.0f} s", "output_tail": output[-3000:]}
        tests = _junit_outcomes(report) if report.is_file() else {}
    outcomes = [t["outcome"] for t in tests.values()]
    return {"status": "failed" if "failed" in outcomes or proc.returncode not in (0, 5) else "ran",
            "passed": outcomes.count("passed"), "failed": outcomes.count("failed"),
            "skipped": outcomes.count("skipped"), "tests": tests, "output_tail": proc.stdout[-3000:]}


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


def cuda_parts(args: argparse.Namespace) -> list[tuple[str, str, Callable[[], Any]]]:
    """(name, estimate key, run) of every part that needs CUDA, in order of priority."""
    first, *others = USER_MODELS
    return [
        (f"bench:{first}", "bench", lambda: train_suite.run(_user_sizes(args, first))),
        ("sft", "sft", lambda: sft.run(_with(args, sft_models=["llama-100m-random"], sft_variants=["padded", "packed"],
                                             batch_size=16, repeats=10, warmup=2, dtype="bfloat16", quick=False,
                                             skip_memory=False))),
        ("icl", "icl", lambda: icl.run(_with(args, model_name="opt-1.3b-random", eval_examples=64, batch_size=16,
                                             repeats=2, warmup=1, dtype="bfloat16", icl_context=0, quick=False))),
        ("compile", "compile", lambda: compile_suite.run(_with(_user_sizes(args, first), repeats=3))),
        *((f"bench:{m}", "bench", lambda m=m: train_suite.run(_user_sizes(args, m))) for m in others),
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part that fits the time budget; the CPU part only where there is no CUDA device."""
    start = time.monotonic()
    left = lambda: args.gpu_budget_s - (time.monotonic() - start)  # noqa: E731
    cuda = torch.cuda.is_available() and args.device != "cpu"
    parts: dict[str, Any] = {"cuda_tests": cuda_tests(max(60.0, left()))} if "cuda_tests" in args.gpu_parts else {}
    if not cuda:
        parts["cpu_bench"] = train_suite.run(_with(args, model_name="tiny-opt", quick=True, skip_hf=True, skip_memory=True,
                                             device="cpu"))
        for name, key, _ in cuda_parts(args):
            if key in args.gpu_parts:
                parts[name] = {"status": "needs CUDA"}
        return {"cuda": False, "parts": parts, "elapsed_s": time.monotonic() - start}
    for name, key, fn in cuda_parts(_with(args, device="cuda")):
        if key not in args.gpu_parts:
            continue
        if left() < ESTIMATE_S[key]:
            parts[name] = {"status": f"skipped: {left():.0f} s left of --gpu_budget_s, needs about {ESTIMATE_S[key]}"}
            continue
        t0 = time.monotonic()
        try:
            parts[name] = {"status": "ran", "results": fn()}
        except Exception as exc:  # noqa: BLE001 -- one broken part must not cost the figures of the others
            parts[name] = {"status": f"failed: {type(exc).__name__}: {str(exc)[:500]}"}
        parts[name]["seconds"] = time.monotonic() - t0
        print(f"[gpu] {name}: {parts[name]['status']} ({parts[name]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return {"cuda": True, "parts": parts, "elapsed_s": time.monotonic() - start}


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
    if name == "sft" and res:
        return "; ".join(f"{r['variant']} {r['speedup_vs_trl']:.2f}x TRL" for r in res)
    if name == "icl" and res:
        return "; ".join(f"{r['task']} {r['speedup_vs_per_pair']:.1f}x per pair" for r in res)
    if name == "compile" and res:
        return "; ".join(f"{r['workload']} {r['compiled_speedup']:.2f}x, warm-up +{r['warmup_extra_s']:.0f} s"
                         for r in res)
    return ""


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table of the parts: status and headline figures; the outcome of every cuda test."""
    lines = [f"GPU suite ({'CUDA' if report['cuda'] else 'no CUDA: CPU part only'}), {report['elapsed_s']:.0f} s",
             "", "| part | status | figures |", "|---|---|---|"]
    for name, part in report["parts"].items():
        status = "ran" if name == "cpu_bench" else part.get("status", "")
        lines.append(f"| {name} | {status} | {_summary(name, part)} |")
    tests = report["parts"].get("cuda_tests", {}).get("tests", {})
    if tests:
        lines += ["", "| cuda test | outcome | message |", "|---|---|---|"]
        lines += [f"| {n} | {t['outcome']} | {t['message']} |" for n, t in tests.items()]
    return "\n".join(lines)
