"""Retrieval evaluation of an embedding model: each query of a held-out split against the pooled corpus of that
split (every distinct document of its pairs, positives and hard negatives), recall@1/5/10 and MRR."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from xgblora.data.pairs import NO_PREFIXES, Prefixes
from xgblora.data.tasks import Example
from xgblora.embeddings.pooling import encode_texts

KS = (1, 5, 10)


def ranks(queries: Tensor, corpus: Tensor, gold: Tensor) -> Tensor:
    """The 1-based rank of each query's gold document by cosine similarity (unit vectors); a tie counts for it."""
    scores = queries @ corpus.T
    gold_score = scores.gather(1, gold[:, None])
    return (scores > gold_score).sum(1) + 1


def metrics(rank: Tensor) -> dict[str, float]:
    """recall@k (the share of queries whose gold document is among the top k) and mean reciprocal rank."""
    if rank.numel() == 0:
        return {**{f"recall@{k}": 0.0 for k in KS}, "mrr": 0.0}
    out = {f"recall@{k}": float((rank <= k).float().mean()) for k in KS}
    out["mrr"] = float((1.0 / rank.float()).mean())
    return out


def evaluate(model: nn.Module, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *, pooling: str,
             max_length: int, batch_size: int, bidirectional: bool = False,
             prefixes: Prefixes = NO_PREFIXES) -> dict[str, Any]:
    """recall@1/5/10 and MRR of the examples' queries against the corpus of their distinct documents."""
    if not examples:
        return {**metrics(torch.empty(0)), "corpus_size": 0, "num_queries": 0}
    corpus = list(dict.fromkeys(d for ex in examples for d in ex.candidates))
    where = {d: i for i, d in enumerate(corpus)}
    options = dict(pooling=pooling, max_length=max_length, batch_size=batch_size, bidirectional=bidirectional)
    docs = encode_texts(model, tokenizer, corpus, prefix=prefixes.doc, **options)
    queries = encode_texts(model, tokenizer, [ex.prompt for ex in examples], prefix=prefixes.query, **options)
    gold = torch.tensor([where[ex.candidates[0]] for ex in examples], dtype=torch.long)
    return {**metrics(ranks(queries, docs, gold)), "corpus_size": len(corpus), "num_queries": len(examples)}
