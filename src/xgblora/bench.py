"""Throughput, memory and limit-ratio measurements against baselines (`xgblora bench`).

Every headline figure is a ratio of two workloads timed side by side in one process, interleaved (A, B, A, B, ...)
and summarised by medians, so that noise from other processes on the machine hits both sides alike. Peak memory is
measured per workload in a fresh subprocess (RSS is a process-lifetime peak on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xgblora.data.batching import TokenSeq
from xgblora.data.tasks import Example
from xgblora.perf import peak_memory_mb

# Targets: key -> (comparison, bound); "<=" means lower is better.
TARGETS: dict[str, tuple[str, float]] = {
    "zo_step_over_two_forwards": ("<=", 1.0),
    "zo_full_step_over_two_forwards": ("<=", 1.15),
    "fo_lora_speedup_vs_hf_peft": (">=", 1.5),
    "eval_speedup_vs_per_candidate": (">=", 5.0),
    "zo_peak_mem_over_inference": ("<=", 1.1),
}
REQUIRED_KEYS = ("zo_step_over_two_forwards", "zo_full_step_over_two_forwards", "fo_lora_speedup_vs_hf_peft",
                 "eval_speedup_vs_per_candidate", "zo_peak_mem_over_inference", "log_overhead_fraction")
MEMORY_WORKLOADS = ("inference", "zo", "zo_full", "adamw")
_ARG_KEYS = ("model_name", "batch_size", "seq_len", "target_len", "repeats", "warmup", "dtype", "device",
             "eval_examples")
_WORDS = ("the", "movie", "was", "great", "and", "story", "fun", "but", "ending", "felt", "long", "so", "I",
          "would", "not", "see", "it", "again", "this", "film", "is", "a", "good", "one", "with", "some", "bad",
          "parts", "very", "dull", "plot", "actors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `xgblora bench`."""
    parser.add_argument("--model_name", "--model-name", default="tiny-opt",
                        help="A built-in random model (tiny-opt, opt-125m-random, ...), a hub id or a local path.")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=8, help="Training batch size (rows).")
    parser.add_argument("--seq_len", "--seq-len", type=int, default=128, help="Tokens per synthetic sequence.")
    parser.add_argument("--target_len", "--target-len", type=int, default=0,
                        help="Scored (target) tokens per sequence; 0 = seq_len // 8.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed repetitions per workload (medians taken).")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed repetitions first.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="Model weight dtype.")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--eval_examples", "--eval-examples", type=int, default=32,
                        help="Examples scored in the evaluation comparison (the first ones of the dev split).")
    parser.add_argument("--eval_task", "--eval-task", default="RTE",
                        help="Task whose templates and dev rows shape the evaluation workload (SST2, RTE, CB, ...).")
    parser.add_argument("--data_dir", "--data-dir", default=None,
                        help="Folder with <task>/dev.jsonl for the evaluation workload; without it, synthetic prompts "
                             "of RTE's length (premise of ~50 words) with its template and Yes/No candidates.")
    parser.add_argument("--json", default=None, metavar="FILE", help="Write every figure to this JSON file.")
    parser.add_argument("--skip_hf", "--skip-hf", action="store_true",
                        help="Skip the Hugging Face Trainer + PEFT baseline.")
    parser.add_argument("--skip_memory", "--skip-memory", action="store_true",
                        help="Skip the per-workload peak-memory subprocesses.")
    parser.add_argument("--quick", action="store_true", help="Smallest sizes (for tests): batch 2, 32 tokens.")


# ----------------------------------------------------------------------------- set-up shared by all workloads

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_seqs(n: int, seq_len: int, n_target: int, vocab: int, seed: int = 0) -> list[TokenSeq]:
    """n random token sequences of seq_len tokens (ids 3.. vocab-1, clear of pad/bos/eos), last n_target scored."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, seq_len), generator=gen).tolist()
    return [TokenSeq(tuple(row), n_target, i, 0) for i, row in enumerate(ids)]


def synthetic_examples(n: int, premise_words: int = 50, seed: int = 0) -> list[Example]:
    """n RTE-shaped examples: a random-word premise and hypothesis in RTE's template, candidates Yes / No."""
    from xgblora.data.tasks import RTE

    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(_WORDS) for _ in range(k)).capitalize() + "."  # noqa: E731
    return [RTE().examples({"premise": words(premise_words), "hypothesis": words(8),
                            "label": rng.choice(["entailment", "not_entailment"])}, ("synthetic", i))[0]
            for i in range(n)]


def eval_examples(args: argparse.Namespace) -> tuple[list[Example], str]:
    """The evaluation workload: the first eval_examples dev examples of eval_task, or synthetic RTE-shaped ones."""
    if args.data_dir is None:
        return synthetic_examples(args.eval_examples), "synthetic RTE-shaped (50-word premise)"
    from xgblora.data.loading import load_rows
    from xgblora.data.tasks import get_task

    task = get_task(args.eval_task)
    return load_rows(task, "eval", args.data_dir)[:args.eval_examples], f"{task.name} dev rows from {args.data_dir}"


class Bench:
    """The models, data and step functions of one benchmark configuration."""

    def __init__(self, args: argparse.Namespace, with_lora: bool = True, with_plain: bool = True):
        from xgblora import models
        from xgblora.adapters import lora

        self.args = args
        self.device = models.choose_device(args.device)
        self.plain, self.tokenizer = (models.load(args.model_name, dtype=args.dtype, device=args.device)
                                      if with_plain else (None, None))
        self.lora_model, self.lora_report = None, None
        if with_lora:
            self.lora_model, tok = models.load(args.model_name, dtype=args.dtype, device=args.device)
            self.tokenizer = self.tokenizer or tok
            self.lora_report = lora.attach(self.lora_model, ["q_proj", "v_proj"], r=8, alpha=16.0)
        model = self.plain if self.plain is not None else self.lora_model
        self.vocab = int(model.config.vocab_size)
        self.n_target = args.target_len or max(1, args.seq_len // 8)
        self.pool = synthetic_seqs(max(64, 4 * args.batch_size), args.seq_len, self.n_target, self.vocab)
        self._cursor = 0
        self._zo_dual = self._zo_full = self._adamw = None

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next training batch from the pool, collated exactly as `xgblora train` does, on the device."""
        from xgblora.objective import make_batch

        b = self.args.batch_size
        rows = [(self._cursor + k) % len(self.pool) for k in range(b)]
        self._cursor = (self._cursor + b) % len(self.pool)
        batch = make_batch(self.pool, rows, self.tokenizer.pad_token_id, {r: [r] for r in rows})
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    # --- workloads: each runs one unit of work and returns nothing (timing is done outside)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One plain forward (per-example loss, no gradients) of the model without adapters."""
        from xgblora.objective import per_example_loss

        self.plain.eval()
        with torch.no_grad():
            return per_example_loss(self.plain, batch)

    def lora_forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One forward (no gradients) of the model with LoRA adapters attached."""
        from xgblora.objective import per_example_loss

        self.lora_model.eval()
        with torch.no_grad():
            return per_example_loss(self.lora_model, batch)

    def zo_step(self, batch: dict[str, torch.Tensor]) -> None:
        """One MeZO step on the LoRA adapters with the dual-batch forward (as `xgblora train --trainer zo`)."""
        from xgblora.objective import per_example_loss
        from xgblora.optim.zo import MeZO

        if self._zo_dual is None:
            named = [(n, p) for n, p in self.lora_model.named_parameters() if ".lora_" in n]
            self._zo_dual = MeZO(named, lr=1e-5, eps=1e-3, dual_modules=self.lora_report.modules)
        self.lora_model.eval()
        self._zo_dual.step(lambda b: per_example_loss(self.lora_model, b), batch)

    def zo_full_step(self, batch: dict[str, torch.Tensor]) -> None:
        """One full-model MeZO step (two forwards, three in-place sweeps over all weights)."""
        from xgblora.adapters.lora import prepare_full_ft
        from xgblora.objective import per_example_loss
        from xgblora.optim.zo import MeZO

        if self._zo_full is None:
            prepare_full_ft(self.plain)
            self._zo_full = MeZO(list(self.plain.named_parameters()), lr=1e-7, eps=1e-3)
        self.plain.eval()
        self._zo_full.step(lambda b: per_example_loss(self.plain, b), batch)

    def adamw_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One AdamW LoRA step: forward, backward, clip to 1.0, fused AdamW, zero_grad (as `xgblora train`)."""
        from xgblora.objective import per_example_loss
        from xgblora.optim import fo

        if self._adamw is None:
            named = [(n, p) for n, p in self.lora_model.named_parameters() if ".lora_" in n]
            self._adamw = (fo.build_optimizer(named, lr=1e-4), [p for _, p in named])
        optimizer, params = self._adamw
        self.lora_model.train()
        loss = per_example_loss(self.lora_model, batch).mean()
        loss.backward()
        fo.clip_grad_norm(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def time_interleaved(workloads: dict[str, Callable[[], Any]], repeats: int, warmup: int,
                     device: torch.device) -> dict[str, list[float]]:
    """Run the workloads round-robin (warmup rounds untimed), returning each one's per-run seconds."""
    times: dict[str, list[float]] = {name: [] for name in workloads}
    for rep in range(warmup + repeats):
        for name, fn in workloads.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- HF Trainer + PEFT baseline

def hf_vs_xgblora(bench: Bench, steps: int, warmup: int) -> dict[str, Any]:
    """HF Trainer + PEFT LoRA (r=8, q/v) steps interleaved one by one with xgblora AdamW LoRA steps.

    A TrainerCallback runs one xgblora step inside each HF on_step_end, so the two alternate in one process;
    an HF step is timed from the end of the xgblora step to the next on_step_end (data loading included), and
    an xgblora step includes its batch collation, like `xgblora train`.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from xgblora import models

    args = bench.args
    hf_model, _ = models.load(args.model_name, dtype=args.dtype, device=args.device)
    hf_model = get_peft_model(hf_model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                   target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    rows = []
    for s in bench.pool:
        ids = torch.tensor(s.ids)
        labels = ids.clone()
        labels[:-s.n_target] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    total = warmup + steps
    hf_times: list[float] = []
    our_times: list[float] = []
    state = {"mark": 0.0, "n": 0}

    class Interleave(TrainerCallback):
        def on_step_end(self, targs, tstate, control, **kwargs):  # noqa: ARG002
            _sync(bench.device)
            now = time.perf_counter()
            state["n"] += 1
            if state["n"] > warmup:
                hf_times.append(now - state["mark"])
            start = time.perf_counter()
            bench.adamw_step(bench.next_batch())
            _sync(bench.device)
            if state["n"] > warmup:
                our_times.append(time.perf_counter() - start)
            state["mark"] = time.perf_counter()
            return control

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(output_dir=tmp, max_steps=total, per_device_train_batch_size=args.batch_size,
                                  learning_rate=1e-4, report_to="none", save_strategy="no", logging_steps=10**9,
                                  disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0,
                                  use_cpu=bench.device.type == "cpu", seed=0)
        trainer = Trainer(model=hf_model, args=targs, train_dataset=rows, callbacks=[Interleave()])
        state["mark"] = time.perf_counter()
        trainer.train()
        optim = str(trainer.args.optim)
    tokens = args.batch_size * args.seq_len
    hf_s, our_s = _median(hf_times), _median(our_times)
    return {"hf_peft_step_s": hf_s, "fo_lora_step_interleaved_s": our_s, "hf_peft_optim": optim,
            "hf_peft_train_tokens_per_s": tokens / hf_s, "hf_peft_train_samples_per_s": args.batch_size / hf_s,
            "fo_lora_speedup_vs_hf_peft": hf_s / our_s, "hf_steps_timed": len(hf_times)}


# ----------------------------------------------------------------------------- evaluation: batched vs one pair per forward

def per_candidate_scores(model: torch.nn.Module, tokenizer: Any, examples: list[Example]) -> list[list[float]]:
    """The naive baseline: tokenise and run one forward per (example, candidate) pair, full logits."""
    device = next(model.parameters()).device
    scores = []
    with torch.inference_mode():
        for ex in examples:
            row = []
            n_prompt = len(tokenizer(ex.prompt)["input_ids"])
            for cand in ex.candidates:
                ids = tokenizer(ex.prompt + cand, return_tensors="pt")["input_ids"].to(device)
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                target = ids[0, 1:]
                lp = logprobs.gather(-1, target[:, None])[n_prompt - 1:, 0]
                row.append(float(lp.mean()))
            scores.append(row)
    return scores


def eval_comparison(bench: Bench, repeats: int, warmup: int) -> dict[str, Any]:
    """candidate_scores (prompt KV cache reused, and without it) vs per_candidate_scores, and the workload's shape."""
    from xgblora.evaluate import candidate_scores

    args = bench.args
    examples, source = eval_examples(args)
    model, tok = bench.plain, bench.tokenizer
    model.eval()
    prompt_tokens = [len(tok(ex.prompt)["input_ids"]) for ex in examples]
    pair_tokens = [len(tok(ex.prompt + c)["input_ids"]) for ex in examples for c in ex.candidates]
    n_pairs = len(pair_tokens)
    times = time_interleaved({
        "batched": lambda: candidate_scores(model, tok, examples, batch_size=args.batch_size),
        "batched_no_cache": lambda: candidate_scores(model, tok, examples, batch_size=args.batch_size,
                                                     prefix_cache=False),
        "per_candidate": lambda: per_candidate_scores(model, tok, examples),
    }, repeats, warmup, bench.device)
    batched, no_cache, single = (_median(times[k]) for k in ("batched", "batched_no_cache", "per_candidate"))
    return {"eval_batched_s": batched, "eval_batched_no_cache_s": no_cache, "eval_per_candidate_s": single,
            "eval_examples_per_s": len(examples) / batched, "eval_tokens_per_s": sum(pair_tokens) / batched,
            "eval_no_cache_examples_per_s": len(examples) / no_cache,
            "eval_per_candidate_examples_per_s": len(examples) / single,
            "eval_speedup_vs_per_candidate": single / batched, "eval_no_cache_speedup_vs_per_candidate": single / no_cache,
            "eval_source": source, "eval_n_examples": len(examples), "eval_n_pairs": n_pairs,
            "eval_mean_prompt_tokens": statistics.mean(prompt_tokens), "eval_max_prompt_tokens": max(prompt_tokens),
            "eval_candidates_per_example": n_pairs / len(examples),
            "eval_mean_candidate_tokens": (sum(pair_tokens) - sum(p * len(ex.candidates) for p, ex in
                                                                  zip(prompt_tokens, examples, strict=True))) / n_pairs,
            "eval_mean_tokens_per_pair": sum(pair_tokens) / n_pairs}


# ----------------------------------------------------------------------------- logging overhead

def log_overhead(step_s: float, n: int = 500) -> dict[str, float]:
    """Mean cost of one MetricsLog.log (the train loop's per-step record, default buffering) over a step's time."""
    from xgblora.logging import MetricsLog

    with tempfile.TemporaryDirectory() as tmp, MetricsLog(Path(tmp) / "metrics.jsonl") as metrics:
        loss = torch.tensor(1.2345)
        start = time.perf_counter()
        for step in range(1, n + 1):
            metrics.log({"step": step, "loss": float(loss), "lr": 1e-4, "elapsed_s": round(step * 0.1, 3)})
        per_log = (time.perf_counter() - start) / n
    return {"log_s_per_record": per_log, "log_overhead_fraction": per_log / step_s}


# ----------------------------------------------------------------------------- peak memory, one subprocess per workload

def _rss_mb() -> float:
    """Current resident set size of this process (Linux /proc), MiB."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssSampler(threading.Thread):
    """Samples the current RSS every `interval` seconds until stopped; `.peak_mb` is the largest sample.

    The process-lifetime peak (ru_maxrss) is useless for comparing workloads on the CPU: building the model
    peaks higher than any workload. Sampling while the workload runs measures the workload alone.
    """

    def __init__(self, interval: float = 5e-4):
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
    _sync(bench.device)
    peak = sampler.stop() if sampler is not None else peak_memory_mb(bench.device)
    return {"peak_mb": peak, "setup_peak_mb": setup_mb}


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Peak memory of each workload, each in its own subprocess (run concurrently; peaks are per process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    code = "import json,sys; from xgblora.bench import memory_worker; print(json.dumps(memory_worker(json.loads(sys.argv[1]))))"
    procs = {}
    for kind in MEMORY_WORKLOADS[:2] if args.quick else MEMORY_WORKLOADS:  # --quick: just the ratio's two
        config = json.dumps({"kind": kind, "args": {k: v for k, v in vars(args).items() if k in _ARG_KEYS}})
        procs[kind] = subprocess.Popen([sys.executable, "-c", code, config], stdout=subprocess.PIPE,
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
    out["memory_kind"] = "cuda max_memory_allocated" if torch.device(_device_name(args)).type == "cuda" \
        else "peak RSS sampled while the workload runs (model set-up excluded)"
    return out


def _device_name(args: argparse.Namespace) -> str:
    from xgblora.models import choose_device

    return str(choose_device(args.device))


# ----------------------------------------------------------------------------- the run

def _versions() -> dict[str, str | None]:
    import transformers

    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                       "transformers": transformers.__version__}
    for pkg in ("peft", "accelerate"):
        if importlib.util.find_spec(pkg) is not None:
            versions[pkg] = __import__(pkg).__version__
    return versions


def apply_quick(args: argparse.Namespace) -> argparse.Namespace:
    """With --quick, shrink sizes and repetitions to the smallest useful ones (in place)."""
    if args.quick:
        args.batch_size, args.seq_len = min(args.batch_size, 2), min(args.seq_len, 32)
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
        args.eval_examples = min(args.eval_examples, 4)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of the benchmark, as one flat dict of figures plus the run's sizes and environment."""
    apply_quick(args)
    torch.manual_seed(0)
    bench = Bench(args)
    device = bench.device
    res: dict[str, Any] = {
        "model_name": args.model_name, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "target_len": bench.n_target, "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup,
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "versions": _versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "total_params": sum(p.numel() for p in bench.plain.parameters()),
        "lora_trainable_params": bench.lora_report.trainable_params,
    }
    batch = bench.next_batch()
    times = time_interleaved({
        "forward": lambda: bench.forward(batch),
        "two_forwards": lambda: (bench.forward(batch), bench.forward(batch)),
        "lora_forward": lambda: bench.lora_forward(batch),
        "zo_step": lambda: bench.zo_step(batch),
        "adamw_lora_step": lambda: bench.adamw_step(batch),
        "zo_full_step": lambda: bench.zo_full_step(batch),
    }, args.repeats, args.warmup, device)
    med = {name: _median(ts) for name, ts in times.items()}
    tokens = args.batch_size * args.seq_len
    res.update({f"{name}_s": value for name, value in med.items()})
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
    res.update(log_overhead(med["adamw_lora_step"]))
    res.update(eval_comparison(bench, args.repeats, args.warmup))
    if args.skip_hf:
        res["fo_lora_speedup_vs_hf_peft"] = None
        res["hf_note"] = "skipped (--skip_hf)"
    elif importlib.util.find_spec("peft") is None:
        res["fo_lora_speedup_vs_hf_peft"] = None
        res["hf_note"] = "skipped: peft is not installed (pip install peft)"
    else:
        res.update(hf_vs_xgblora(bench, max(args.repeats, 3), max(args.warmup, 1)))
    if args.skip_memory:
        res["zo_peak_mem_over_inference"] = None
    else:
        res.update(measure_memory(args))
    return res


def _verdict(key: str, value: Any) -> tuple[str, str]:
    if key not in TARGETS:
        return "", ""
    op, bound = TARGETS[key]
    if not isinstance(value, float | int) or not math.isfinite(value):
        return f"{op} {bound:g}", "n/a"
    met = value <= bound if op == "<=" else value >= bound
    return f"{op} {bound:g}", "pass" if met else "miss"


_TABLE = [
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


def format_table(res: dict[str, Any]) -> str:
    """One line per measurement: name, value, target, pass/miss."""
    head = (f"xgblora bench: {res['model_name']} ({res['total_params']:,} params), batch {res['batch_size']} x "
            f"{res['seq_len']} tokens ({res['target_len']} scored), {res['dtype']}, {res['device']} "
            f"({res['device_name']}, {res['cpu_threads']} threads), median of {res['repeats']} interleaved")
    lines = [head, f"{'measurement':<36} {'value':>14} {'target':>8}  result", "-" * 68]
    for key, label, unit in _TABLE:
        if key not in res:
            continue
        value = res[key]
        target, verdict = _verdict(key, value)
        if value is None:
            shown = "skipped"
        elif unit == "s":
            shown = f"{value * 1000:.2f} ms"
        elif unit == "x":
            shown = f"{value:.4g}x" if key != "log_overhead_fraction" else f"{value:.2e}"
        elif unit == "MiB":
            shown = f"{value:.1f} MiB"
        else:
            shown = f"{value:,.1f}"
        lines.append(f"{label:<36} {shown:>14} {target:>8}  {verdict}")
    if res.get("hf_note"):
        lines.append(f"HF baseline: {res['hf_note']}")
    if "eval_source" in res:
        lines.append(f"eval workload: {res['eval_source']}, {res['eval_n_examples']} examples, prompts of "
                     f"{res['eval_mean_prompt_tokens']:.0f} tokens (max {res['eval_max_prompt_tokens']}), "
                     f"{res['eval_candidates_per_example']:.1f} candidates of {res['eval_mean_candidate_tokens']:.1f} "
                     f"tokens each, batch {res['batch_size']} prompts")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print its table, and write the JSON when --json is given."""
    with contextlib.redirect_stdout(sys.stderr):  # HF Trainer prints its summary; keep stdout for the table
        res = run(args)
    print(format_table(res), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0
