"""A batch of right-padded rows embedded in length-sorted pieces, each cut to its own longest row.

A contrastive batch is padded to its longest text, so a batch of mixed lengths runs many padding tokens: at 16
RTE premises or GSM8K answers, 1.7-2x the tokens its pieces need. `length_pieces` cuts the rows, sorted by
length, where the padding saved outweighs the fixed cost of one more forward (`split_cost`, in tokens);
`embed_in_pieces` embeds each piece with its graph and puts the rows back in order. The embeddings, and so the
loss and its gradients, are those of the batch in one piece (every row attends to its own tokens only; with
dropout, other masks of the same law); the activations kept are fewer, since fewer tokens run.

MeZO's dual batch (halves=2: rows [:n] at +eps z, rows [n:] at -eps z, told apart by position) is cut in aligned
pieces, the same rows of both halves together, so that every piece is a dual batch of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

EmbedFn = Callable[[Tensor, Tensor], Tensor]  # (input_ids, attention_mask) -> embeddings [rows, H]

# A forward's fixed cost in padded tokens, measured on a 2-core Intel Xeon (all-MiniLM-L6-v2 with frozen weights: 12-13 ms a
# forward and backward of one short row, 0.44 ms a token; BENCHMARKS.md, "Plain batches in pieces").
SPLIT_COST_TOKENS = 32.0


def split_cost(requested: bool | None, device: torch.device) -> float | None:
    """The cost of one more piece, or None for the batch in one piece: as requested (--embed_pieces), by default
    on the CPU only (on a GPU a small piece's kernels under-fill it, which the padding saved may not repay)."""
    on = requested if requested is not None else device.type == "cpu"
    return SPLIT_COST_TOKENS if on else None


def trim(ids: Tensor, mask: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The given rows, cut after the last column any of them attends to."""
    ids, mask = ids[rows], mask[rows]
    width = int(mask.any(0).nonzero().max()) + 1 if mask.any() else mask.shape[1]
    return ids[:, :width], mask[:, :width]


def longest_first(lengths: Tensor, halves: int = 1) -> Tensor:
    """Row indices of the first half, longest first (the halves hold the same rows)."""
    return torch.argsort(lengths[:len(lengths) // halves].cpu(), descending=True, stable=True)


def aligned(order: Tensor, bounds: Sequence[tuple[int, int]], halves: int) -> list[Tensor]:
    """The rows order[start:end] of every half, for each (start, end)."""
    per_half = len(order)
    return [torch.cat([h * per_half + order[start:end] for h in range(halves)]) for start, end in bounds]


def length_pieces(lengths: Tensor, split_cost: float, halves: int = 1) -> list[Tensor]:
    """Row indices of each piece: the rows sorted longest first, cut where it saves the most.

    A piece costs its rows x its longest row in tokens, plus `split_cost` for the forward it adds; the cuts are
    the least-cost partition of the sorted rows into consecutive runs (dynamic programming, O(rows^2) in
    Python: under a millisecond at 64 rows, beside forwards of a second or more)."""
    order = longest_first(lengths, halves)
    widths = lengths[:len(order)].cpu()[order].tolist()
    n = len(widths)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the longest j rows
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            cost = best[start] + (end - start) * widths[start] * halves + split_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    bounds, end = [], n
    while end > 0:
        bounds.append((cut[end], end))
        end = cut[end]
    return aligned(order, bounds[::-1], halves)


def embed_in_pieces(embed_fn: EmbedFn, ids: Tensor, mask: Tensor, pieces: Sequence[Tensor]) -> Tensor:
    """Embeddings [N, H] of all rows, each piece embedded (with its graph) at its own width, in the rows' order."""
    if len(pieces) == 1:
        return embed_fn(ids, mask)
    vectors = torch.cat([embed_fn(*trim(ids, mask, rows)) for rows in pieces])
    return vectors[torch.argsort(torch.cat(pieces)).to(vectors.device)]
