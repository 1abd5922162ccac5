"""`xgblora bench --suite sft`: xgblora's instruction-SFT step against TRL's `SFTTrainer` + PEFT LoRA.

Both sides train the same random Llama-shaped model (LoRA r=8, alpha 16, every linear layer of the blocks, no
dropout, the bench's dtype, AdamW lr 1e-4, clip 1.0; TRL's bf16 autocast, on by default in its configs and on a
CPU with bf16 instructions twice as fast a matmul, only with --dtype bfloat16) on the same batches: GSM8K rows as a user/assistant
conversation through TinyLlama-Chat's template, tokenised once by `formats.instruction_seqs` (the assistant turn
and its end-of-turn token carry loss), taken in file order, `batch_size` rows a step, loss the mean over the
batch's target tokens. TRL gets the rows as `input_ids` + `labels` (-100 off the targets), so both see the same
tokens. One xgblora step runs beside each TRL step, on the rows of that step, before or after it in turn
(`timing.InterleavedSteps`: on a GPU, whichever side meets a new padded shape first pays for its kernel choice).
Variants: padded or packed (TRL's `padding_free`, xgblora's `collate_packed`), with or without gradient
checkpointing (non-reentrant on both sides); xgblora's loss through its fused LM head (the default) or, `+logits`,
from the full logits; `+liger`, Liger's kernels on both sides (CUDA: RMSNorm, RoPE and SwiGLU in xgblora's model
with its own fused head; TRL's `use_liger_kernel`, Liger's fused linear cross-entropy included). Padded, each side
pads as it does for its users: TRL to the longest row, xgblora to the longest row rounded up to a multiple of 64 on
CUDA (`collation.pad_multiple`).

Peak memory: each side in its own process, what its steps add to the memory held before them (the peak RSS sampled
during the steps minus the RSS before the first; CUDA: max_memory_allocated over memory_allocated before), so the
libraries each side imports do not count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from xgblora.adapters import lora
from xgblora.bench import flops
from xgblora.bench.memory import memory_cell, peak_added, run_against_baseline, sides_in_subprocesses
from xgblora.bench.profile import profile_slowest
from xgblora.bench.timing import InterleavedSteps, against_trainer, step_stats, sync_device
from xgblora.data import formats
from xgblora.data.collation import TokenSeq, pad_multiple
from xgblora.data.tasks import Example
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.models.kernels import use_liger_kernels
from xgblora.optim.fo import AdamWStepper
from xgblora.train.objective import TrainingLoss, sequence_training_set

SFT_MODELS = ("llama-100m-random", "llama-100m-128k-random")
VARIANTS = ("padded", "packed", "padded+gc", "packed+gc")
LORA = dict(r=8, alpha=16.0, targets="all-linear")
LR = 1e-4
MEMORY_STEPS = 2  # the optimizer state is created in the first step, the second runs with it


@dataclass(frozen=True)
class SFTCase:
    """One comparison: a model, a batch layout, gradient checkpointing or not, and the sizes."""

    model_name: str
    packed: bool
    checkpointing: bool
    batch_size: int
    steps: int  # timed steps, after `warmup` untimed ones
    warmup: int
    dtype: str = "float32"
    device: str = "cpu"
    data_dir: str = ""
    rows: int = 0  # GSM8K rows tokenised (the steps' batches come from them in order)
    max_length: int = 1024
    pad_to_multiple_of: int = 0  # xgblora's padded widths; 0: the device's default (collation.pad_multiple)
    fused_head: bool = True  # xgblora's loss through the fused LM head (--fused_lm_head)
    liger: bool = False  # Liger's kernels on both sides (--use_liger_kernel, TRL's use_liger_kernel; CUDA only)

    @property
    def variant(self) -> str:
        return (("packed" if self.packed else "padded") + ("+gc" if self.checkpointing else "")
                + ("" if self.fused_head else "+logits") + ("+liger" if self.liger else ""))


# ----------------------------------------------------------------------------- data

def generated_conversations(n: int) -> list[Example]:
    """n GSM8K-shaped conversations made up here (a question of 25-75 words, a worked answer of 40-160 words ending
    in '#### N'; seeded), for a run without --data_dir: the timing depends on lengths, not on the words."""
    rng = random.Random(0)
    words = ("apples", "pens", "cost", "each", "more", "than", "half", "twice", "left", "total", "dollars", "week",
             "books", "had", "gave", "how", "many")
    examples = []
    for i in range(n):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(25, 75))) + "?"
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(40, 160))) + f"\n#### {rng.randint(1, 999)}"
        examples.append(Example("", (), (), messages=(("user", question), ("assistant", answer)),
                                source=f"generated:{i + 1}"))
    return examples


def gsm8k_conversations(data_dir: str, n: int) -> list[Example]:
    """The first n rows of GSM8K's train split as user (question) / assistant (worked answer) conversations;
    generated ones without a data_dir."""
    if not data_dir:
        return generated_conversations(n)
    path = Path(data_dir) / "gsm8k" / "train.jsonl"
    if not path.is_file():
        raise UserError(f"--suite sft reads GSM8K rows from {path}, which does not exist (pass --data_dir)")
    examples = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in zip(range(1, n + 1), f, strict=False):
            row = json.loads(line)
            examples.append(Example("", (), (), messages=(("user", row["question"]), ("assistant", row["answer"])),
                                    source=f"{path}:{line_no}"))
    return examples


def chat_tokenizer(model_name: str) -> Any:
    """The model's tokenizer, with TinyLlama-Chat's template where it has none (the built-in random models)."""
    if model_name in pretrained.RANDOM_MODELS:
        tokenizer = pretrained.tiny_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(pretrained.resolve_path(model_name))
    tokenizer.chat_template = tokenizer.chat_template or pretrained.ZEPHYR_CHAT_TEMPLATE
    return tokenizer


def sft_seqs(case: SFTCase) -> list[TokenSeq]:
    """The case's training sequences: enough GSM8K conversations for warm-up and timed steps."""
    n = case.rows or case.batch_size * (case.warmup + case.steps)
    return formats.instruction_seqs(chat_tokenizer(case.model_name), gsm8k_conversations(case.data_dir, n),
                                    case.max_length)


def step_rows(case: SFTCase, step: int) -> list[int]:
    """Indices of the sequences of step `step` (0-based): the rows in order, batch_size a step."""
    return list(range(step * case.batch_size, (step + 1) * case.batch_size))


def trl_rows(seqs: list[TokenSeq]) -> list[dict[str, list[int]]]:
    """The sequences as TRL rows: input_ids and labels (the token where it carries loss, else -100)."""
    rows = []
    for s in seqs:
        labels = [-100] * len(s.ids)
        for k in s.target_offsets():
            labels[k] = s.ids[k]
        rows.append({"input_ids": list(s.ids), "labels": labels})
    return rows


def batch_tokens(seqs: list[TokenSeq], rows: list[int]) -> tuple[int, int]:
    """(all tokens, target tokens) of a batch, padding not counted."""
    return sum(len(seqs[r].ids) for r in rows), sum(len(seqs[r].target_offsets()) for r in rows)


# ----------------------------------------------------------------------------- the two sides

class XgbloraSFT:
    """xgblora's SFT step: LoRA on every linear layer, token-mean loss, `AdamWStepper`, as `xgblora train` runs it."""

    def __init__(self, case: SFTCase, seqs: list[TokenSeq]) -> None:
        self.device = pretrained.choose_device(case.device)
        self.model, tokenizer = pretrained.load(case.model_name, dtype=case.dtype, device=case.device,
                                                build_on_device=True)
        lora.attach(self.model, LORA["targets"], r=LORA["r"], alpha=LORA["alpha"])
        if case.liger:
            use_liger_kernels(self.model, self.device)
        if case.checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.pad_multiple = case.pad_to_multiple_of or pad_multiple(self.device)
        self.train_set = sequence_training_set(seqs, tokenizer.pad_token_id, case.packed, token_mean=True,
                                               pad_to_multiple_of=self.pad_multiple)
        params = lora.adapter_params(self.model)
        self.lora_params = sum(p.numel() for _, p in params)
        self.stepper = AdamWStepper(params, TrainingLoss(self.model, fused_head=case.fused_head),
                                    max_grad_norm=1.0, micro_batch=case.batch_size)

    def step(self, rows: list[int]) -> torch.Tensor:
        """One training step on the given sequences (collation included, as in the train loop)."""
        self.model.train()
        batch = self.train_set.batch(rows).to(self.device)
        return self.stepper.step(lambda: batch, lr=LR)


def trl_trainer(case: SFTCase, seqs: list[TokenSeq], callbacks: list[Any], output_dir: str) -> Any:
    """TRL's SFTTrainer with PEFT LoRA shaped like xgblora's, over the same rows in the same order."""
    from datasets import Dataset
    from peft import LoraConfig
    from torch.utils.data import SequentialSampler
    from trl import SFTConfig, SFTTrainer

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    model, tokenizer = pretrained.load(case.model_name, dtype=case.dtype, device=case.device,
                                       build_on_device=True)
    tokenizer.chat_template = tokenizer.chat_template or pretrained.ZEPHYR_CHAT_TEMPLATE
    config = SFTConfig(
        output_dir=output_dir, max_steps=case.warmup + case.steps, per_device_train_batch_size=case.batch_size,
        learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, gradient_checkpointing=case.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, padding_free=case.packed, max_length=None,
        report_to="none", save_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=pretrained.choose_device(case.device).type == "cpu", seed=0, bf16=case.dtype == "bfloat16",
        use_liger_kernel=case.liger)
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    return InOrder(model=model, args=config, train_dataset=Dataset.from_list(trl_rows(seqs)),
                   processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)


# ----------------------------------------------------------------------------- timing, interleaved

def compare_case(case: SFTCase) -> dict[str, Any]:
    """TRL and xgblora steps alternating on the same batches: per-step times, tokens/s, the speed-up."""
    seqs = sft_seqs(case)
    ours = XgbloraSFT(case, seqs)
    timer = InterleavedSteps(lambda index: ours.step(step_rows(case, index)), ours.device, case.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(case, seqs, [timer.callback()], tmp)
        timer.start()
        trainer.train()
    trl_times, our_times = timer.trainer_s, timer.ours_s
    timed = [step_rows(case, s) for s in range(case.warmup, case.warmup + case.steps)]
    tokens = [batch_tokens(seqs, rows) for rows in timed]
    all_tokens, target_tokens = sum(t[0] for t in tokens), sum(t[1] for t in tokens)
    trl_s, our_s = sum(trl_times), sum(our_times)
    per_token = flops.flops_per_token(ours.model.config, round(all_tokens / (len(timed) * case.batch_size)),
                                      "train_lora", ours.lora_params)
    return {
        "model_name": case.model_name, "variant": case.variant, **against_trainer(trl_times, our_times),
        "trl_mixed_precision": trainer.accelerator.mixed_precision,
        "flops_per_token": per_token, "xgblora_mfu": flops.mfu(all_tokens / our_s, per_token, ours.device),
        "trl_mfu": flops.mfu(all_tokens / trl_s, per_token, ours.device),
        **_widths(case, seqs, ours.pad_multiple),
        "xgblora_profile": profile_slowest(our_times, lambda i: ours.step(step_rows(case, case.warmup + i)),
                                           ours.device),
        "xgblora_tokens_per_s": all_tokens / our_s, "trl_tokens_per_s": all_tokens / trl_s,
        "xgblora_target_tokens_per_s": target_tokens / our_s, "trl_target_tokens_per_s": target_tokens / trl_s,
        "mean_tokens_per_row": all_tokens / (len(timed) * case.batch_size),
        "target_share": target_tokens / all_tokens,
    }


def _widths(case: SFTCase, seqs: list[TokenSeq], multiple: int) -> dict[str, Any]:
    """Each step's padded width on both sides (TRL pads to the longest row), from the first warm-up step on, and
    whether xgblora's was new to the run: on a GPU the first step at a width pays for its kernel plans."""
    if case.packed:
        return {}
    longest = [max(len(seqs[r].ids) for r in step_rows(case, s)) for s in range(case.warmup + case.steps)]
    ours = [-(-n // multiple) * multiple for n in longest]
    return {"pad_to_multiple_of": multiple, "trl_widths": longest, "xgblora_widths": ours,
            "xgblora_new_width": [w not in ours[:k] for k, w in enumerate(ours)]}


# (label, padding multiple, cuDNN attention allowed), in the order each step runs them: the first meets every
# exact width first with cuDNN's SDPA off, so what the second pays on a new width beyond it is cuDNN's plan
SHAPE_SIDES = (("as they come, cuDNN attention off", 1, False), ("as they come", 1, True),
               ("multiple of 64", 64, True))


def shape_case(case: SFTCase) -> dict[str, Any]:
    """xgblora's padded steps alone, interleaved step by step on the same rows (SHAPE_SIDES): widths as they come
    with and without cuDNN attention, and widened to a multiple of 64; per-step times, widths, and which steps met
    a new width. Where the slow steps of padded training come from, in one comparison."""
    seqs = sft_seqs(case)
    sides = [(label, cudnn, XgbloraSFT(dataclasses.replace(case, pad_to_multiple_of=m), seqs))
             for label, m, cudnn in SHAPE_SIDES]
    times: dict[str, list[float]] = {label: [] for label, _, _ in SHAPE_SIDES}
    cudnn_default = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for step in range(case.warmup + case.steps):
            for label, cudnn, side in sides:
                torch.backends.cuda.enable_cudnn_sdp(cudnn and cudnn_default)
                t = _timed_step(side, step_rows(case, step))
                if step >= case.warmup:
                    times[label].append(t)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_default)
    return {"model_name": case.model_name, "steps_timed": case.steps, "warmup": case.warmup,
            "cudnn_sdp_enabled": cudnn_default,
            "sides": {label: {**step_stats(times[label]), **_widths(case, seqs, side.pad_multiple)}
                      for label, _, side in sides}}


def _timed_step(side: XgbloraSFT, rows: list[int]) -> float:
    sync_device(side.device)
    start = time.perf_counter()
    side.step(rows)
    sync_device(side.device)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- memory, one process per side

def memory_worker(config: dict[str, Any]) -> dict[str, float]:
    """In a fresh process: one side's first MEMORY_STEPS steps of a case, and the memory they add (MiB)."""
    case, side = SFTCase(**config["case"]), config["side"]
    case = dataclasses.replace(case, warmup=0, steps=MEMORY_STEPS)
    seqs = sft_seqs(case)
    n_steps = MEMORY_STEPS
    if side == "xgblora":
        ours = XgbloraSFT(case, seqs)
        with peak_added(ours.device) as mem:
            for step in range(n_steps):
                ours.step(step_rows(case, step))
        return mem
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(case, seqs, [], tmp)
        with peak_added(pretrained.choose_device(case.device)) as mem:
            trainer.train()
    return mem


def measure_case_memory(case: SFTCase) -> dict[str, Any]:
    """Each side's memory for the case, one subprocess after the other (so they do not share the cores)."""
    return sides_in_subprocesses("xgblora.bench.sft", asdict(case), f"SFT {case.variant}")


# ----------------------------------------------------------------------------- the suite

def cases(args: argparse.Namespace) -> list[SFTCase]:
    """Every (model, variant) the flags ask for."""
    models_ = args.sft_models or list(SFT_MODELS)
    variants = args.sft_variants or list(VARIANTS)
    return [SFTCase(model_name=m, packed=v.startswith("packed"), checkpointing="+gc" in v,
                    fused_head="+logits" not in v, liger=v.endswith("+liger"),
                    batch_size=args.batch_size, steps=args.repeats, warmup=args.warmup, dtype=args.dtype,
                    device=args.device, data_dir=args.data_dir or "", max_length=args.max_length)
            for m in models_ for v in variants]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of the SFT comparison: timing interleaved in this process, memory in subprocesses."""
    if not args.data_dir:
        print("[sft] no --data_dir: timing on generated GSM8K-shaped conversations (pass --data_dir DIR with "
              "gsm8k/train.jsonl for the real rows)", file=sys.stderr, flush=True)
    return run_against_baseline("sft", cases(args), compare_case, measure_case_memory, format_table, args.skip_memory)


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per model and variant, with the targets' verdicts."""
    lines = ["| model | variant | tokens/row (target share) | xgblora tok/s (target) | TRL tok/s (target) | "
             "speed-up (median step) | memory added xgblora / TRL (MiB) | >= 1.5x | memory <= TRL |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = memory_cell(r)
        mem_ok = ("pass" if r["mem_added_over_trl"] <= 1.0 else "miss") if "mem_added_over_trl" in r else "n/a"
        lines.append(
            f"| {r['model_name']} | {r['variant']} | {r['mean_tokens_per_row']:.0f} ({r['target_share']:.0%}) | "
            f"{r['xgblora_tokens_per_s']:.0f} ({r['xgblora_target_tokens_per_s']:.0f}) | "
            f"{r['trl_tokens_per_s']:.0f} ({r['trl_target_tokens_per_s']:.0f}) | "
            f"{r['speedup_vs_trl']:.2f}x ({r['speedup_vs_trl_median_step']:.2f}x) | {mem} | "
            f"{'pass' if r['speedup_vs_trl'] >= 1.5 else 'miss'} | {mem_ok} |")
    return "\n".join(lines)
