"""The baselines of the speed-up figures: HF Trainer + PEFT LoRA training, and one forward per (example, candidate)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

import torch

from xgblora.bench.timing import InterleavedSteps, median, time_interleaved
from xgblora.bench.workloads import Bench, eval_examples
from xgblora.data.collation import TokenSeq
from xgblora.data.tasks import Example
from xgblora.evaluation.candidates import candidate_scores
from xgblora.models import pretrained

try:  # optional: `xgblora bench` skips this baseline without peft (see suite.run)
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments
except ImportError as exc:
    HF_IMPORT_ERROR: ImportError | None = exc
else:
    HF_IMPORT_ERROR = None


# ----------------------------------------------------------------------------- HF Trainer + PEFT baseline

def _peft_lora_model(args: argparse.Namespace) -> torch.nn.Module:
    """The benchmark's model with PEFT LoRA adapters shaped like Bench's (r=8, alpha 16, q/v, no dropout)."""
    model, _ = pretrained.load(args.model_name, dtype=args.dtype, device=args.device, build_on_device=True)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


def _trainer_rows(pool: list[TokenSeq]) -> list[dict[str, torch.Tensor]]:
    """Bench's sequences as HF Trainer rows: labels -100 except on the scored tokens."""
    rows = []
    for s in pool:
        ids = torch.tensor(s.ids)
        labels = ids.clone()
        labels[:-s.n_target] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows


def _training_arguments(output_dir: str, bench: Bench, max_steps: int) -> TrainingArguments:
    """HF TrainingArguments matching Bench's AdamW LoRA step (lr 1e-4, batch size), with no logging or saving."""
    return TrainingArguments(output_dir=output_dir, max_steps=max_steps,
                             per_device_train_batch_size=bench.args.batch_size, learning_rate=1e-4,
                             report_to="none", save_strategy="no", logging_steps=10**9, disable_tqdm=True,
                             remove_unused_columns=False, dataloader_num_workers=0,
                             use_cpu=bench.device.type == "cpu", seed=0)


def hf_vs_xgblora(bench: Bench, steps: int, warmup: int) -> dict[str, Any]:
    """HF Trainer + PEFT LoRA (r=8, q/v) steps interleaved one by one with xgblora AdamW LoRA steps.

    A TrainerCallback runs one xgblora step inside each HF on_step_end, so the two alternate in one process;
    an HF step is timed from the end of the xgblora step to the next on_step_end (data loading included), and
    an xgblora step includes its batch collation, like `xgblora train`.
    """
    if HF_IMPORT_ERROR is not None:
        raise HF_IMPORT_ERROR
    args = bench.args
    hf_model = _peft_lora_model(args)
    rows = _trainer_rows(bench.pool)
    timer = InterleavedSteps(lambda index: bench.adamw_step(bench.next_batch()), bench.device, warmup,
                             alternate=False)
    with tempfile.TemporaryDirectory() as tmp:
        targs = _training_arguments(tmp, bench, warmup + steps)
        trainer = Trainer(model=hf_model, args=targs, train_dataset=rows, callbacks=[timer.callback()])
        timer.start()
        trainer.train()
        optim = str(trainer.args.optim)
    hf_times, our_times = timer.trainer_s, timer.ours_s
    tokens = args.batch_size * args.seq_len
    hf_s, our_s = median(hf_times), median(our_times)
    return {"hf_peft_step_s": hf_s, "fo_lora_step_interleaved_s": our_s, "hf_peft_optim": optim,
            "hf_peft_train_tokens_per_s": tokens / hf_s, "hf_peft_train_samples_per_s": args.batch_size / hf_s,
            "fo_lora_speedup_vs_hf_peft": hf_s / our_s, "hf_steps_timed": len(hf_times),
            "step_times_s": {"hf_peft_step": hf_times, "fo_lora_step_interleaved": our_times}}


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
    batched, no_cache, single = (median(times[k]) for k in ("batched", "batched_no_cache", "per_candidate"))
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
