"""The contrastive objective of embedding training: InfoNCE over a batch's documents (every process's), the
symmetric variant, a fixed or learnt temperature, Matryoshka embeddings (the loss summed over the embeddings cut to
several sizes), and GRIT's weighted sum with the generative loss; the batch's texts embedded in one piece, in
length-sorted pieces or by gradient caching."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from xgblora.data.batches import GritBatch, PairBatch
from xgblora.embeddings.gradcache import cached_embed
from xgblora.embeddings.pieces import embed_in_pieces, length_pieces
from xgblora.embeddings.pooling import embed

Gather = Callable[[Tensor], tuple[Tensor, int]]  # this rank's rows -> (every rank's rows, where this rank's start)


def info_nce(queries: Tensor, docs: Tensor, positive: Tensor, doc_key: Tensor, scale: Tensor | float,
             gather: Gather | None = None, symmetric: bool = False) -> Tensor:
    """Each query's InfoNCE loss [B]: cross-entropy of its positive among all documents of the batch (every
    process's, when `gather` collects them), on scale x cosine similarity of unit vectors.

    A document with the same text as a query's positive (another query's copy of it) is left out of that query's
    negatives: it is not one. symmetric: the mean of that and each positive's cross-entropy of its query among all
    queries (sentence-transformers' MultipleNegativesSymmetricRankingLoss: MultipleNegativesRankingLoss with
    directions query_to_doc and doc_to_query, partition_mode per_direction).
    """
    keys, offset = (doc_key, 0) if gather is None else gather(doc_key)
    all_docs = docs if gather is None else gather(docs)[0]
    target = positive + offset
    rows = torch.arange(len(target), device=target.device)
    scores = queries @ all_docs.T * scale
    same = keys[None, :] == doc_key[positive][:, None]
    same[rows, target] = False
    loss = nn.functional.cross_entropy(scores.masked_fill(same, float("-inf")), target, reduction="none")
    if not symmetric:
        return loss
    all_queries = queries if gather is None else gather(queries)[0]
    query_keys = doc_key[positive] if gather is None else gather(doc_key[positive])[0]
    back = docs[positive] @ all_queries.T * scale
    same = query_keys[None, :] == doc_key[positive][:, None]  # a query whose positive is this document's copy
    same[rows, rows + offset] = False
    return (loss + nn.functional.cross_entropy(back.masked_fill(same, float("-inf")), rows + offset,
                                               reduction="none")) / 2


def matryoshka_nce(queries: Tensor, docs: Tensor, dims: tuple[int, ...], dim_weights: tuple[float, ...],
                   nce: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """sentence-transformers' MatryoshkaLoss: sum_d w_d x the loss `nce` of the unit vectors of the embeddings'
    first d dimensions (cut before normalising, so every cut is a unit vector of its own)."""
    def unit(x: Tensor, d: int) -> Tensor:
        return nn.functional.normalize(x[:, :d], dim=-1)

    return sum(w * nce(unit(queries, d), unit(docs, d)) for d, w in zip(dims, dim_weights, strict=True))


class Contrastive(nn.Module):
    """The embedding objective: pooling, attention direction, temperature (fixed, or learnt as a log-scale), the
    cross-process gather of documents, GRIT's weights, the instruction tokens left out of the pooling (`skips`: of
    queries and documents; GritLM's), the symmetric loss, Matryoshka sizes and their weights (`dims`,
    `dim_weights`; () : the full embedding alone), gradient caching (`mini_batch` > 0: queries and documents
    embedded that many rows at a time, `gradcache`), and otherwise length-sorted pieces (`split_cost`, in tokens, a
    forward's fixed cost: `pieces`; None: the batch in one piece). Owns its one parameter, the learnable
    log-scale."""

    def __init__(self, pooling: str, temperature: float, learnable: bool = False, bidirectional: bool = False,
                 gather: Gather | None = None, weights: tuple[float, float] = (1.0, 1.0), mini_batch: int = 0,
                 skips: tuple[int, int] = (0, 0), symmetric: bool = False, split_cost: float | None = None,
                 dims: tuple[int, ...] = (), dim_weights: tuple[float, ...] | None = None):
        super().__init__()
        self.pooling, self.bidirectional, self.gather, self.weights = pooling, bidirectional, gather, weights
        self.mini_batch, self.skips, self.symmetric, self.split_cost = mini_batch, skips, symmetric, split_cost
        self.dims = tuple(dims)
        self.dim_weights = tuple(dim_weights) if dim_weights is not None else (1.0,) * len(self.dims)
        log_scale = torch.tensor(math.log(1 / temperature))
        self.log_scale = nn.Parameter(log_scale) if learnable else None
        self.fixed_scale = 1 / temperature

    @property
    def scale(self) -> Tensor | float:
        """1 / temperature (a learnt one is capped at 100, as CLIP caps it)."""
        return self.fixed_scale if self.log_scale is None else self.log_scale.exp().clamp(max=100.0)

    def forward(self, model: nn.Module, batch: PairBatch) -> Tensor:
        """Per-query InfoNCE [halves x B]; each half of MeZO's dual batch is its own contrastive batch."""
        q = self.embed(model, batch.query_ids, batch.query_mask, batch.halves, self.skips[0])
        d = self.embed(model, batch.doc_ids, batch.doc_mask, batch.halves, self.skips[1])

        def nce(queries: Tensor, docs: Tensor) -> Tensor:
            return info_nce(queries, docs, batch.positive, batch.doc_key, self.scale, self.gather, self.symmetric)

        # Matryoshka: the embeddings (cached ones too) are computed once, in full, and cut inside the loss, so one
        # backward reaches the model through every size's loss (sentence-transformers' CachedLossDecorator)
        halves = zip(q.chunk(batch.halves), d.chunk(batch.halves), strict=True)
        if not self.dims:
            return torch.cat([nce(qh, dh) for qh, dh in halves])
        return torch.cat([matryoshka_nce(qh, dh, self.dims, self.dim_weights, nce) for qh, dh in halves])

    def embed(self, model: nn.Module, ids: Tensor, mask: Tensor, halves: int, skip: int = 0) -> Tensor:
        """Unit embeddings of the rows (their first `skip` tokens not pooled; with Matryoshka sizes not yet
        normalised): `mini_batch` rows of each half at a time (gradient caching), else in length-sorted pieces (with
        `split_cost`), else in one piece."""
        def embed_rows(rows_ids: Tensor, rows_mask: Tensor) -> Tensor:
            return embed(model, rows_ids, rows_mask, self.pooling, self.bidirectional, skip, normalize=not self.dims)

        if self.mini_batch and ids.shape[0] > self.mini_batch * halves:
            return cached_embed(embed_rows, ids, mask, self.mini_batch, halves)
        if self.split_cost is None:
            return embed_rows(ids, mask)
        return embed_in_pieces(embed_rows, ids, mask, length_pieces(mask.sum(1), self.split_cost, halves))

    def grit(self, model: nn.Module, batch: GritBatch, generative: Tensor) -> Tensor:
        """w_c x each query's InfoNCE + w_g x its half's mean generative loss (so the mean is GRIT's loss), given
        `generative`, the per-example losses of the batch's instruction rows (the training loss of their kind)."""
        contrastive = self(model, batch.pairs)
        generative = generative.chunk(batch.pairs.halves)
        w_c, w_g = self.weights
        per_half = contrastive.chunk(batch.pairs.halves)
        return torch.cat([w_c * c + w_g * g.mean() for c, g in zip(per_half, generative, strict=True)])
