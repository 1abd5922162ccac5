"""`xgblora bench --suite embed`: xgblora's contrastive step against sentence-transformers' trainer + PEFT LoRA.

Both sides train the same embedding model (all-MiniLM-L6-v2 by default) with LoRA r=8, alpha 16 on the attention
query and value projections, no dropout, AdamW at a constant rate, clipping 1.0, mean pooling and scale 20
(sentence-transformers' MultipleNegativesRankingLoss; xgblora's temperature 0.05), on the same batches: query ->
document pairs shuffled once with seed 0, then taken in order, `batch` pairs a step, each text cut to
`max_length` tokens. Above `mini_batch` pairs both embed by gradient caching (sentence-transformers'
CachedMultipleNegativesRankingLoss, xgblora's --mini_batch_size); below it, xgblora embeds as its training does by
default on the device (in length-sorted pieces on the CPU, `--embed_pieces`). One xgblora step runs beside each
trainer step on that step's rows, before or after it in turn (`timing.InterleavedSteps`). The pairs
(`--embed_pairs`) are MultiRC questions -> their paragraphs (long texts, most cut to `max_length`), GSM8K questions
-> their worked answers or RTE hypotheses -> their premises (lengths that vary row to row, as in most
question-answer data), read from --data_dir, else generated pairs of the same lengths.

Peak memory: each side in its own process, what its steps add to the memory held before them (the peak RSS sampled
during the steps on the CPU; max_memory_allocated on CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from xgblora.adapters import lora
from xgblora.bench import flops
from xgblora.bench.memory import memory_cell, peak_added, run_against_baseline, sides_in_subprocesses
from xgblora.bench.profile import profile_slowest
from xgblora.bench.timing import InterleavedSteps, step_stats
from xgblora.data.pairs import pair_seqs
from xgblora.data.sources import read_jsonl
from xgblora.data.tasks import Example, MultiRC
from xgblora.embeddings.contrastive import Contrastive
from xgblora.embeddings.pieces import split_cost
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.optim.fo import AdamWStepper
from xgblora.train.objective import TrainingLoss, pair_training_set

LORA = dict(r=8, alpha=16.0, targets=["query", "value"])
LR = 1e-4
SCALE = 20.0
MEMORY_STEPS = 2  # the optimizer state is created in the first step, the second runs with it


@dataclass(frozen=True)
class EmbedCase:
    """One comparison: a model, a batch of pairs (cached above `mini_batch`), the text length and the steps."""

    model_name: str
    batch: int
    mini_batch: int
    max_length: int
    steps: int  # timed steps, after `warmup` untimed ones
    warmup: int
    device: str = "cpu"
    data_dir: str = ""
    pairs: str = "multirc"  # a key of PAIR_SETS

    @property
    def cached(self) -> bool:
        return self.batch > self.mini_batch

    @property
    def variant(self) -> str:
        return f"batch {self.batch}" + (f", cached (mini-batch {self.mini_batch})" if self.cached else "")


# ----------------------------------------------------------------------------- data

def generated_pairs(n: int, query_words: tuple[int, int], doc_words: tuple[int, int]) -> list[tuple[str, str]]:
    """n pairs made up here with the given word counts (seeded): the timing depends on lengths, not on the words."""
    rng = random.Random(0)
    words = ("the", "river", "town", "king", "said", "after", "years", "when", "ship", "found", "gold", "north",
             "letter", "mother", "war", "school", "why", "did")
    return [(" ".join(rng.choice(words) for _ in range(rng.randint(*query_words))) + "?",
             " ".join(rng.choice(words) for _ in range(rng.randint(*doc_words))) + ".") for _ in range(n)]


def data_rows(data_dir: str, relative: str) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file of --data_dir."""
    path = Path(data_dir) / relative
    if not path.is_file():
        raise UserError(f"--suite embed reads its pairs from {path}, which does not exist (pass --data_dir)")
    return [row for _, row in read_jsonl(path)]


def multirc_pairs(data_dir: str) -> list[tuple[str, str]]:
    """Every (question, paragraph) of MultiRC's train split, markup removed as the MultiRC task removes it."""
    pairs = []
    for row in data_rows(data_dir, "multirc/train.jsonl"):
        text = MultiRC.paragraph_text(row["passage"]["text"])
        pairs.extend((q["question"], text) for q in row["passage"]["questions"])
    return pairs


def gsm8k_pairs(data_dir: str) -> list[tuple[str, str]]:
    """Every (question, worked answer) of GSM8K's train split."""
    return [(row["question"], row["answer"]) for row in data_rows(data_dir, "gsm8k/train.jsonl")]


def rte_pairs(data_dir: str) -> list[tuple[str, str]]:
    """Every (hypothesis, premise) of RTE's train split, whatever its label: a hypothesis is about its premise."""
    return [(row["hypothesis"], row["premise"]) for row in data_rows(data_dir, "rte/train.jsonl")]


# name -> (reader, word counts of generated stand-ins: query, document)
PAIR_SETS = {"multirc": (multirc_pairs, (8, 16), (150, 300)), "gsm8k": (gsm8k_pairs, (20, 80), (20, 160)),
             "rte": (rte_pairs, (5, 20), (10, 90))}


def case_pairs(case: EmbedCase) -> list[tuple[str, str]]:
    """The pairs of the case's warm-up and timed steps, in the order both sides train on them."""
    n = case.batch * (case.warmup + case.steps)
    read, query_words, doc_words = PAIR_SETS[case.pairs]
    pairs = read(case.data_dir) if case.data_dir else generated_pairs(n, query_words, doc_words)
    random.Random(0).shuffle(pairs)
    if len(pairs) < n:
        raise UserError(f"--suite embed: {n} pairs needed for the steps asked, {len(pairs)} available")
    return pairs[:n]


def step_rows(case: EmbedCase, step: int) -> list[int]:
    """Indices of the pairs of step `step` (0-based): in order, `batch` a step."""
    return list(range(step * case.batch, (step + 1) * case.batch))


@functools.cache
def model_folder(name: str) -> str:
    """The folder both sides load the model from: a built-in random model saved once per process (in a temporary
    folder removed at exit), so that sentence-transformers reads the very weights xgblora trains."""
    if name not in pretrained.RANDOM_MODELS:
        return pretrained.resolve_path(name)
    folder = Path(_SAVED.name) / name
    model, tokenizer = pretrained.random_model(name, head="embed")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


_SAVED = tempfile.TemporaryDirectory(prefix="xgblora-bench-")


# ----------------------------------------------------------------------------- the two sides

class XgbloraContrastive:
    """xgblora's contrastive step as `xgblora train --objective contrastive` runs it: LoRA, InfoNCE over the batch
    (gradient caching above mini_batch), `AdamWStepper`."""

    def __init__(self, case: EmbedCase, pairs: list[tuple[str, str]]) -> None:
        self.device = pretrained.choose_device(case.device)
        folder = model_folder(case.model_name)
        self.model, tokenizer = pretrained.load(folder, device=case.device,
                                                head=pretrained.embedding_head(folder, "contrastive"))
        lora.attach(self.model, LORA["targets"], r=LORA["r"], alpha=LORA["alpha"])
        examples = [Example(query, (doc,), (0,)) for query, doc in pairs]
        self.seqs = pair_seqs(tokenizer, examples, case.max_length)
        self.train_set = pair_training_set(self.seqs, tokenizer.pad_token_id)
        self.lora_params = sum(p.numel() for _, p in lora.adapter_params(self.model))
        contrastive = Contrastive("mean", 1 / SCALE, mini_batch=case.mini_batch if case.cached else 0,
                                  split_cost=split_cost(None, self.device))
        self.loss = TrainingLoss(self.model, contrastive=contrastive)
        self.stepper = AdamWStepper(lora.adapter_params(self.model), self.loss, max_grad_norm=1.0,
                                    micro_batch=case.batch)

    def step(self, rows: list[int]) -> torch.Tensor:
        """One training step on the given pairs (collation included, as in the train loop)."""
        self.model.train()
        batch = self.train_set.batch(rows).to(self.device)
        return self.stepper.step(lambda: batch, lr=LR)


def st_trainer(case: EmbedCase, pairs: list[tuple[str, str]], callbacks: list[Any], output_dir: str) -> Any:
    """sentence-transformers' trainer with PEFT LoRA shaped like xgblora's, over the same pairs in the same order."""
    from datasets import Dataset
    from peft import LoraConfig, TaskType, inject_adapter_in_model
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
    from torch.utils.data import BatchSampler, SequentialSampler

    class InOrder(SentenceTransformerTrainer):
        def get_batch_sampler(self, dataset, batch_size, drop_last, *args, **kwargs):  # noqa: ARG002
            return BatchSampler(SequentialSampler(dataset), batch_size, drop_last)

    device = pretrained.choose_device(case.device)
    model = SentenceTransformer(model_folder(case.model_name), device=str(device))
    model.max_seq_length = case.max_length
    # PEFT's own injection (model.add_adapter asks transformers for a newer PEFT than some installs have)
    inject_adapter_in_model(LoraConfig(task_type=TaskType.FEATURE_EXTRACTION, r=LORA["r"], lora_alpha=LORA["alpha"],
                                       lora_dropout=0.0, target_modules=LORA["targets"]), model[0].auto_model)
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    config = SentenceTransformerTrainingArguments(
        output_dir=output_dir, max_steps=case.warmup + case.steps, per_device_train_batch_size=case.batch,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=0,
        save_strategy="no", report_to="none", logging_steps=10**9, use_cpu=device.type == "cpu",
        dataloader_num_workers=0, disable_tqdm=True)
    loss = (CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=case.mini_batch) if case.cached
            else MultipleNegativesRankingLoss(model, scale=SCALE))
    dataset = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [d for _, d in pairs]})
    return InOrder(model=model, args=config, train_dataset=dataset, loss=loss, callbacks=callbacks)


# ----------------------------------------------------------------------------- timing, interleaved

def compare_case(case: EmbedCase) -> dict[str, Any]:
    """sentence-transformers and xgblora steps alternating on the same batches: per-step times and the speed-up."""
    pairs = case_pairs(case)
    ours = XgbloraContrastive(case, pairs)
    timer = InterleavedSteps(lambda index: ours.step(step_rows(case, index)), ours.device, case.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = st_trainer(case, pairs, [timer.callback()], tmp)
        timer.start()
        trainer.train()
    st_times, our_times = timer.trainer_s, timer.ours_s
    rows = [r for s in range(case.warmup, case.warmup + case.steps) for r in step_rows(case, s)]
    texts = [t for r in rows for t in (ours.seqs[r].query, *ours.seqs[r].docs)]
    tokens = sum(len(t) for t in texts)  # unpadded; the model FLOPs of a text of mean length
    per_token = flops.flops_per_token(ours.model.config, round(tokens / len(texts)), "train_lora", ours.lora_params,
                                      lm_head=False)
    return {
        "model_name": case.model_name, "pairs": case.pairs, "variant": case.variant, "max_length": case.max_length,
        "steps_timed": len(our_times), "st_step_s": st_times, "xgblora_step_s": our_times,
        "xgblora_step_stats": step_stats(our_times), "st_step_stats": step_stats(st_times),
        "flops_per_token": per_token, "xgblora_mfu": flops.mfu(tokens / sum(our_times), per_token, ours.device),
        "st_mfu": flops.mfu(tokens / sum(st_times), per_token, ours.device),
        "xgblora_profile": profile_slowest(our_times, lambda i: ours.step(step_rows(case, case.warmup + i)),
                                           ours.device),
        "speedup_vs_st": sum(st_times) / sum(our_times),
        "speedup_vs_st_median_step": statistics.median(s / o for s, o in zip(st_times, our_times, strict=True)),
        "xgblora_pairs_per_s": case.batch * len(our_times) / sum(our_times),
        "st_pairs_per_s": case.batch * len(st_times) / sum(st_times),
    }


# ----------------------------------------------------------------------------- memory, one process per side

def memory_worker(config: dict[str, Any]) -> dict[str, float]:
    """In a fresh process: one side's first MEMORY_STEPS steps of a case, and the memory they add (MiB)."""
    case = dataclasses.replace(EmbedCase(**config["case"]), warmup=0, steps=MEMORY_STEPS)
    pairs = case_pairs(case)
    if config["side"] == "xgblora":
        ours = XgbloraContrastive(case, pairs)
        with peak_added(ours.device) as mem:
            for step in range(MEMORY_STEPS):
                ours.step(step_rows(case, step))
        return mem
    with tempfile.TemporaryDirectory() as tmp:
        trainer = st_trainer(case, pairs, [], tmp)
        with peak_added(pretrained.choose_device(case.device)) as mem:
            trainer.train()
    return mem


def measure_case_memory(case: EmbedCase) -> dict[str, Any]:
    """Each side's memory for the case, one subprocess after the other (so they do not share the cores)."""
    return sides_in_subprocesses("xgblora.bench.embed", asdict(case), f"embed {case.variant}", baseline="st")


# ----------------------------------------------------------------------------- the suite

def cases(args: argparse.Namespace) -> list[EmbedCase]:
    """One case per pair set and batch size the flags ask for."""
    return [EmbedCase(model_name=args.embed_model, batch=batch, mini_batch=args.mini_batch_size,
                      max_length=args.embed_max_length, steps=args.repeats, warmup=args.warmup, device=args.device,
                      data_dir=args.data_dir or "", pairs=pairs)
            for pairs in args.embed_pairs for batch in args.embed_batches]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of the comparison: timing interleaved in this process, memory in subprocesses."""
    return run_against_baseline("embed", cases(args), compare_case, measure_case_memory, format_table,
                                args.skip_memory)


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per case."""
    lines = ["| model | pairs | variant | max length | xgblora pairs/s | sentence-transformers pairs/s | speed-up (median "
             "step) | memory added xgblora / sentence-transformers (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = memory_cell(r, "st")
        lines.append(f"| {r['model_name']} | {r['pairs']} | {r['variant']} | {r['max_length']} | "
                     f"{r['xgblora_pairs_per_s']:.2f} | {r['st_pairs_per_s']:.2f} | {r['speedup_vs_st']:.2f}x "
                     f"({r['speedup_vs_st_median_step']:.2f}x) | {mem} |")
    return "\n".join(lines)
