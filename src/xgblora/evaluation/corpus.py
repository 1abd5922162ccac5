"""Retrieval over a corpus, scored as sentence-transformers' InformationRetrievalEvaluator scores it: every query
ranks the whole corpus by cosine similarity, ties going to the smaller document id (string order), the corpus
embedded CORPUS_CHUNK documents at a time; then, averaged over the queries, accuracy@k (a relevant document in the
top k), precision@k and recall@k, MRR@10, nDCG@10 (binary gains: relevant or not) and MAP@100 (the precisions at
the relevant hits of the top 100 over min(100, relevant documents)). With Matryoshka sizes, the same at each size
d: the embeddings cut to their first d dimensions (sentence-transformers' truncate_dim; cosine renormalises)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from xgblora.data.beir import RetrievalSet
from xgblora.data.pairs import Prefixes
from xgblora.embeddings.pooling import encode_texts

ACCURACY_AT = (1, 3, 5, 10)
PRECISION_RECALL_AT = (1, 3, 5, 10, 100)
MRR_AT = (10,)
NDCG_AT = (10,)
MAP_AT = (100,)
MAX_K = max(*ACCURACY_AT, *PRECISION_RECALL_AT, *MRR_AT, *NDCG_AT, *MAP_AT)
CORPUS_CHUNK = 50_000  # sentence-transformers' corpus_chunk_size: documents embedded and scored at once
QUERY_BLOCK = 1024  # queries scored against a chunk at once: a [1024, 50000] float32 block is 200 MB

Hits = tuple[Tensor, Tensor]  # per query: the scores and corpus positions of its best documents, best first


def ranked(scores: Tensor, ranks: Tensor, k: int) -> Tensor:
    """The columns of each row's k best entries, best first: the highest scores, ties to the lowest rank (a
    document's place in id order). torch.topk breaks ties arbitrarily, so the ties at the k-th score are chosen by
    rank, and the chosen are sorted by rank, then stably by score."""
    k = min(k, scores.shape[1])
    kth = scores.topk(k, dim=1).values[:, -1:]
    span = int(ranks.max()) + 1 if ranks.numel() else 1
    keys = torch.where(scores > kth, ranks, torch.where(scores == kth, ranks + span, 2 * span))
    chosen = keys.topk(k, dim=1, largest=False).indices
    chosen = chosen.gather(1, ranks.gather(1, chosen).argsort(dim=1))
    return chosen.gather(1, scores.gather(1, chosen).argsort(dim=1, descending=True, stable=True))


def cut(vectors: Tensor, dim: int | None) -> Tensor:
    """Unit vectors cut to their first dim dimensions and made unit again (None: as they are)."""
    return vectors if dim is None else nn.functional.normalize(vectors[:, :dim], dim=-1)


def merge(best: Hits, queries: Tensor, docs: Tensor, start: int, id_rank: Tensor, depth: int = MAX_K) -> Hits:
    """The `depth` best documents of each query among its best so far and a chunk of the corpus (positions start,
    start + 1, ... of the corpus), by cosine of unit vectors."""
    positions = torch.arange(start, start + docs.shape[0])
    scores_out, positions_out = [], []
    for q in range(0, queries.shape[0], QUERY_BLOCK):
        block = slice(q, q + QUERY_BLOCK)
        scores = torch.cat([best[0][block], queries[block] @ docs.T], dim=1)
        candidates = torch.cat([best[1][block], positions.expand(scores.shape[0], -1)], dim=1)
        keep = ranked(scores, id_rank[candidates], depth)
        scores_out.append(scores.gather(1, keep))
        positions_out.append(candidates.gather(1, keep))
    return torch.cat(scores_out), torch.cat(positions_out)


def search(model: nn.Module, tokenizer: PreTrainedTokenizerBase, data: RetrievalSet, prefixes: Prefixes,
           dims: Sequence[int | None], depth: int = MAX_K, **encoding: Any) -> dict[int | None, list[list[str]]]:
    """Each query's `depth` best document ids, best first, at each size of dims (None: the whole embedding);
    `encoding`: encode_texts' options (pooling, max_length, batch_size, bidirectional, include_prompt)."""
    queries = encode_texts(model, tokenizer, list(data.queries.values()), prefix=prefixes.query, **encoding)
    doc_ids = list(data.corpus)
    id_rank = torch.empty(len(doc_ids), dtype=torch.long)
    id_rank[torch.tensor(sorted(range(len(doc_ids)), key=doc_ids.__getitem__))] = torch.arange(len(doc_ids))
    empty = (torch.empty(len(data.queries), 0), torch.empty(len(data.queries), 0, dtype=torch.long))
    best = dict.fromkeys(dims, empty)
    for start in range(0, len(doc_ids), CORPUS_CHUNK):
        chunk = [data.corpus[i] for i in doc_ids[start:start + CORPUS_CHUNK]]
        docs = encode_texts(model, tokenizer, chunk, prefix=prefixes.doc, **encoding)
        for dim in dims:
            best[dim] = merge(best[dim], cut(queries, dim), cut(docs, dim), start, id_rank, depth)
    return {dim: [[doc_ids[p] for p in row] for row in hits[1].tolist()] for dim, hits in best.items()}


def figures(hits: Sequence[Sequence[str]], relevant: Sequence[set[str]]) -> dict[str, float]:
    """The figures of each query's ranked document ids against its relevant ones, averaged over the queries."""
    each = [_query_figures(ids, wanted) for ids, wanted in zip(hits, relevant, strict=True)]
    return {name: float(np.mean([f[name] for f in each])) for name in each[0]}


def _query_figures(ids: Sequence[str], wanted: set[str]) -> dict[str, float]:
    found = [doc in wanted for doc in ids]
    out = {f"accuracy@{k}": float(any(found[:k])) for k in ACCURACY_AT}
    for k in PRECISION_RECALL_AT:
        out[f"precision@{k}"] = sum(found[:k]) / k
        out[f"recall@{k}"] = sum(found[:k]) / len(wanted)
    for k in MRR_AT:
        out[f"mrr@{k}"] = next((1 / (i + 1) for i, hit in enumerate(found[:k]) if hit), 0.0)
    for k in NDCG_AT:
        ideal = sum(1 / math.log2(i + 2) for i in range(min(len(wanted), k)))
        out[f"ndcg@{k}"] = sum(1 / math.log2(i + 2) for i, hit in enumerate(found[:k]) if hit) / ideal
    for k in MAP_AT:
        hit_ranks = [i for i, hit in enumerate(found[:k]) if hit]
        out[f"map@{k}"] = sum((n + 1) / (i + 1) for n, i in enumerate(hit_ranks)) / min(k, len(wanted))
    return out


def evaluate(model: nn.Module, tokenizer: PreTrainedTokenizerBase, data: RetrievalSet, prefixes: Prefixes,
             dims: Sequence[int | None] = (None,), **encoding: Any) -> dict[int | None, dict[str, float]]:
    """The figures at each size of dims (None: the whole embedding); `encoding` as in `search`."""
    return figures_of(data, search(model, tokenizer, data, prefixes, dims, **encoding))


def figures_of(data: RetrievalSet, hits: dict[int | None, list[list[str]]]) -> dict[int | None, dict[str, float]]:
    """The figures of each size's ranked document ids (`search`'s), the MAX_K best of each query."""
    relevant = [data.relevant[q] for q in data.queries]
    return {dim: figures([ids[:MAX_K] for ids in ranked_ids], relevant) for dim, ranked_ids in hits.items()}
