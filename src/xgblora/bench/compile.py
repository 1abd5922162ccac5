"""`xgblora bench --suite compile`: what `--compile` (torch.compile of the model, as `train/loop.py` does it) gains
or costs per AdamW LoRA and MeZO LoRA (dual batch) step after warm-up, and what the warm-up costs.

Two copies of the model with the same LoRA adapters, one run eagerly and one through `torch.compile`, each with
its own stepper; the batches have three lengths in turn (seq_len and seq_len -/+ 16, as length-grouped batches
vary), so the warm-up includes the recompilation for a second shape (dynamic after the first). Warm-up: the first
`warmup_steps` steps of each workload on the compiled copy minus the same steps eagerly; per step: eager and
compiled steps interleaved after warm-up, medians.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from xgblora.adapters import lora
from xgblora.bench.timing import median, sync_device
from xgblora.bench.workloads import synthetic_seqs
from xgblora.data.batches import TokenBatch
from xgblora.data.collation import collate
from xgblora.models import pretrained
from xgblora.optim.fo import AdamWStepper
from xgblora.optim.zo import MeZO, ZOStepper
from xgblora.train.objective import TrainingLoss

WORKLOADS = ("adamw", "zo")


def _batches(args: argparse.Namespace, vocab: int, pad_id: int, device: torch.device) -> list[TokenBatch]:
    """Batches of three lengths (seq_len, seq_len - 16, seq_len + 16), the last seq_len // 8 tokens scored."""
    lengths = (args.seq_len, max(8, args.seq_len - 16), args.seq_len + 16)
    return [collate(synthetic_seqs(args.batch_size, n, max(1, n // 8), vocab, seed=k), pad_id).to(device)
            for k, n in enumerate(lengths)]


def _stepper(args: argparse.Namespace, kind: str, compiled: bool) -> tuple[Any, torch.nn.Module]:
    """A fresh LoRA copy of the model and the stepper of `kind` over it, its forward compiled or not."""
    model, _ = pretrained.load(args.model_name, dtype=args.dtype, device=args.device, build_on_device=True)
    report = lora.attach(model, ["q_proj", "v_proj"], r=8, alpha=16.0)
    params = lora.adapter_params(model)
    loss_fn = TrainingLoss(torch.compile(model) if compiled else model)
    if kind == "adamw":
        model.train()
        return AdamWStepper(params, loss_fn, max_grad_norm=1.0, micro_batch=args.batch_size), model
    model.eval()
    mezo = MeZO(params, lr=1e-5, eps=1e-3, dual_modules=report.modules)
    return ZOStepper(mezo, loss_fn, device=pretrained.choose_device(args.device)), model


def _timed(stepper: Any, batch: TokenBatch, device: torch.device) -> float:
    sync_device(device)
    start = time.perf_counter()
    stepper.step(lambda: batch, lr=1e-5)
    sync_device(device)
    return time.perf_counter() - start


def compare_workload(args: argparse.Namespace, kind: str, warmup_steps: int = 6) -> dict[str, Any]:
    """Eager vs compiled steps of one workload: warm-up cost, then interleaved per-step medians."""
    device = pretrained.choose_device(args.device)
    torch._dynamo.reset()  # noqa: SLF001 -- each workload compiles from scratch, as a new run would
    eager, _ = _stepper(args, kind, compiled=False)
    compiled, model = _stepper(args, kind, compiled=True)
    batches = _batches(args, int(model.config.vocab_size), model.config.pad_token_id or 0, device)
    eager_warm = [_timed(eager, batches[k % 3], device) for k in range(warmup_steps)]
    compiled_warm = [_timed(compiled, batches[k % 3], device) for k in range(warmup_steps)]
    eager_s, compiled_s = [], []
    for k in range(args.repeats * 3):
        batch = batches[k % 3]
        eager_s.append(_timed(eager, batch, device))
        compiled_s.append(_timed(compiled, batch, device))
    e, c = median(eager_s), median(compiled_s)
    extra = sum(compiled_warm) - sum(eager_warm)
    return {"workload": kind, "eager_step_s": e, "compiled_step_s": c, "compiled_speedup": e / c,
            "warmup_steps": warmup_steps, "eager_warmup_s": sum(eager_warm), "compiled_warmup_s": sum(compiled_warm),
            "warmup_extra_s": extra, "first_compiled_step_s": compiled_warm[0],
            "break_even_steps": extra / (e - c) if e > c else None,
            "raw_times_s": {"eager_warmup": eager_warm, "compiled_warmup": compiled_warm, "eager": eager_s,
                            "compiled": compiled_s}}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both workloads on the bench's model."""
    return [{"model_name": args.model_name, "batch_size": args.batch_size, "seq_len": args.seq_len,
             **compare_workload(args, kind)} for kind in WORKLOADS]


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per workload."""
    lines = ["| model, batch | step | eager / compiled per step (ms) | speed-up | warm-up extra (s; first step) | "
             "break-even (steps) |", "|---|---|---|---|---|---|"]
    for r in results:
        even = f"{r['break_even_steps']:.0f}" if r["break_even_steps"] is not None else "never"
        lines.append(f"| {r['model_name']}, {r['batch_size']} x {r['seq_len']} | {r['workload']} | "
                     f"{r['eager_step_s'] * 1e3:.1f} / {r['compiled_step_s'] * 1e3:.1f} | "
                     f"{r['compiled_speedup']:.3f}x | {r['warmup_extra_s']:.1f} ({r['first_compiled_step_s']:.1f}) | "
                     f"{even} |")
    return "\n".join(lines)
