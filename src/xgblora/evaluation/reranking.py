"""Reranking evaluation, scored as sentence-transformers' CrossEncoderRerankingEvaluator scores it: each query's
documents (its positives and negatives, or a first stage's ranked documents) are scored by the cross-encoder
(CrossEncoder.predict's sigmoid of the logit), ranked, and MRR@10, nDCG@10 and MAP are averaged over the queries (a
query with no relevant document among its documents counts 0). With a first stage's ranking, the same figures of
that ranking come beside them (base_*): its relevant documents it missed ranked after all of its own.

Ties in the scores go as that evaluator's do: MRR takes numpy's argsort of the scores, reversed; nDCG averages the
gains of tied documents over their ranks (scikit-learn's ndcg_score); MAP counts tied documents as one threshold
(scikit-learn's average_precision_score). The formulas are computed here, so scikit-learn is not needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn
from transformers import PreTrainedTokenizerBase

from xgblora.data.tasks import Example
from xgblora.embeddings.rerank import score_pairs

AT_K = 10  # the evaluator's at_k: MRR@10 and nDCG@10

Scorer = Callable[[Sequence[tuple[str, str]]], np.ndarray]  # (query, document) pairs -> their scores


@dataclass(frozen=True)
class RerankSample:
    """A query, its relevant documents and the documents ranked for it: its negatives (`ranked` false), or a first
    stage's ranking, best first (`ranked` true; it may hold relevant documents and miss some)."""

    query: str
    positives: tuple[str, ...]
    documents: tuple[str, ...]
    ranked: bool = False


def mrr(relevant: np.ndarray, scores: np.ndarray, k: int = AT_K) -> float:
    """1 / the rank of the first relevant document among the k best (argsort of the scores, reversed); 0 past k."""
    ranking = np.argsort(scores)[::-1]
    return next((1 / (rank + 1) for rank, index in enumerate(ranking[:k]) if relevant[index]), 0.0)


def ndcg(relevant: np.ndarray, scores: np.ndarray, k: int = AT_K) -> float:
    """nDCG@k of the gains `relevant` ranked by the scores, tied documents sharing the mean of their gains; 0 for a
    query without gain."""
    discount = 1 / np.log2(np.arange(len(scores)) + 2)
    discount[k:] = 0.0
    cumulative = np.cumsum(discount)
    _, tie_group, tie_counts = np.unique(-scores, return_inverse=True, return_counts=True)
    mean_gain = np.zeros(len(tie_counts))
    np.add.at(mean_gain, tie_group, relevant)
    ends = np.cumsum(tie_counts) - 1
    dcg = float(np.dot(mean_gain / tie_counts, np.diff(cumulative[ends], prepend=0.0)))
    ideal = float(np.dot(np.sort(relevant)[::-1], discount))
    return dcg / ideal if ideal > 0 else 0.0


def average_precision(relevant: np.ndarray, scores: np.ndarray) -> float:
    """The mean over the relevant documents of the precision at their score, tied documents taken together (a step
    of the precision-recall curve per distinct score)."""
    order = np.argsort(-scores, kind="mergesort")
    hits, ranked = np.asarray(relevant, dtype=float)[order], scores[order]
    last_of_tie = np.r_[np.nonzero(np.diff(ranked))[0], len(ranked) - 1]
    found = np.cumsum(hits)[last_of_tie]
    precision = found / (last_of_tie + 1)
    return float(np.sum(np.diff(found, prepend=0.0) * precision) / found[-1])


def figures(relevant: Sequence[int], scores: np.ndarray) -> tuple[float, float, float]:
    """MRR@10, nDCG@10 and average precision of one query's documents."""
    gains = np.asarray(relevant, dtype=float)
    return mrr(gains, scores), ndcg(gains, scores), average_precision(gains, scores)


def rerank(samples: Sequence[RerankSample], score: Scorer, always_rerank_positives: bool = True) -> dict[str, float]:
    """The evaluator's figures of the samples (map, mrr@10, ndcg@10; base_* where the samples are a first stage's
    rankings): the documents of every sample scored in one call of `score`. always_rerank_positives: a ranked
    sample's relevant documents are all scored, those the first stage missed too."""
    base, plans, pairs = [], [], []
    for s in samples:
        if s.ranked:
            base.append(_base_figures(s))
        docs = s.documents if s.ranked and not always_rerank_positives else \
            (*s.positives, *(d for d in s.documents if d not in s.positives))
        relevant = [int(d in s.positives) for d in docs]
        plans.append(relevant if any(relevant) else None)
        if any(relevant):
            pairs.extend((s.query, d) for d in docs)
    scores, start, each = score(pairs) if pairs else np.empty(0), 0, []
    for relevant in plans:
        if relevant is None:
            each.append((0.0, 0.0, 0.0))
            continue
        each.append(figures(relevant, scores[start:start + len(relevant)]))
        start += len(relevant)
    out = _means(each, "")
    return {**out, **_means(base, "base_")} if base else out


def _base_figures(sample: RerankSample) -> tuple[float, float, float]:
    """The first stage's figures: its ranking, the relevant documents it missed after it."""
    relevant = [int(d in sample.positives) for d in sample.documents]
    if not any(relevant):
        return 0.0, 0.0, 0.0
    relevant += [1] * (len(sample.positives) - sum(relevant))
    return figures(relevant, np.arange(len(relevant), 0, -1, dtype=float))


def _means(each: Sequence[tuple[float, float, float]], prefix: str) -> dict[str, float]:
    values = np.asarray(each, dtype=float).reshape(-1, 3).mean(0)
    return {f"{prefix}map": float(values[2]), f"{prefix}mrr@{AT_K}": float(values[0]),
            f"{prefix}ndcg@{AT_K}": float(values[1])}


def samples_of(examples: Sequence[Example]) -> list[RerankSample]:
    """Reranker rows grouped by query: its passages labelled above 0 are relevant, the others its negatives (a
    passage given twice counted once, relevant where any row says so)."""
    labels: dict[str, dict[str, float]] = {}
    for ex in examples:
        passages = labels.setdefault(ex.prompt, {})
        for passage, label in zip(ex.candidates, ex.labels, strict=True):
            passages[passage] = max(label, passages.get(passage, label))
    return [RerankSample(query, tuple(p for p, x in passages.items() if x > 0),
                         tuple(p for p, x in passages.items() if x <= 0))
            for query, passages in labels.items()]


def evaluate(model: nn.Module, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *, max_length: int,
             batch_size: int) -> dict[str, Any]:
    """The reranker's figures over the examples' queries, each ranking its own positives and negatives; nDCG@10
    first (the evaluator's primary metric: the one that picks a run's best step)."""
    samples = samples_of(examples)
    if not samples:
        return {f"ndcg@{AT_K}": 0.0, "map": 0.0, f"mrr@{AT_K}": 0.0, "num_queries": 0}

    def score(pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        return score_pairs(model, tokenizer, pairs, max_length, batch_size).numpy()

    figures = rerank(samples, score)
    return {f"ndcg@{AT_K}": figures[f"ndcg@{AT_K}"], **figures, "num_queries": len(samples)}
