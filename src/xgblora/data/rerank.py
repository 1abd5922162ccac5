"""Rows for a cross-encoder reranker, read through the same sources and one-line errors as every custom task, and
batched as (query, passage) pairs tokenised as sentence-transformers' CrossEncoder tokenises them.

A row is one of
- a labelled pair: query, passage and label (0/1 or a graded number: sentence-transformers' labeled-pair format);
- a labelled list: query, passages and labels, one per passage (its labeled-list format, LambdaLoss's input);
- a query, its positive and optional hard negatives (negative, negative_1, ... or a list negatives: the contrastive
  pair rows, and `xgblora mine`'s output): the positive labelled 1, the negatives 0.

A row is an `Example` whose prompt is the query, whose candidates are its passages and whose labels are theirs (gold:
the passages labelled above 0), so the train/dev/eval sampling of custom tasks applies unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import BatchEncoding, PreTrainedTokenizerBase

from xgblora.config import DataOptions
from xgblora.data.batches import RerankBatch
from xgblora.data.pairs import hard_negatives
from xgblora.data.sources import parse_columns
from xgblora.data.tasks import CustomTask, Example, Fields
from xgblora.errors import UserError


class RerankTask(CustomTask):
    """Reranker rows (see the module docstring) from --train_file/--eval_file; --columns maps other names, e.g.
    query=question,passage=answer."""

    name, dir_name = "rerank", "rerank"
    metric, generation, instruction = "ndcg@10", False, False

    def __init__(self, cfg: DataOptions):
        if not cfg.train_file and not (cfg.evaluation_only and cfg.eval_file):
            raise UserError("--objective rerank needs --train_file with rows of query, passage and label (0/1 or "
                            "graded), of query, passages and labels, or of query, positive and optional negatives; "
                            "--columns maps your names, e.g. query=question,passage=answer")
        self.train_file, self.eval_file = cfg.train_file, cfg.eval_file
        self.columns = parse_columns(cfg.columns)

    def build(self, r: Fields) -> list[Example]:
        query = r.text("query")
        if r.has("passages") or r.has("labels"):
            passages, labels = r.texts("passages"), r.numbers("labels")
            if len(labels) != len(passages):
                raise r.error("labels", f"{len(labels)} labels for {len(passages)} passages; give one per passage")
        elif r.has("positive"):
            passages = [r.text("positive"), *hard_negatives(r)]
            labels = [1.0] + [0.0] * (len(passages) - 1)
        else:
            passages, labels = [r.text("passage")], [r.number("label")]
        return [Example(query, tuple(passages), tuple(i for i, x in enumerate(labels) if x > 0), labels=tuple(labels),
                        source=r.source)]


def check_rows(examples: Sequence[Example], loss: str) -> None:
    """Refuse, in one line naming the row, what --rerank_loss cannot train on: a label outside [0, 1] for binary
    cross-entropy, a row without its positive first for MNRL; and LambdaLoss on rows of one passage each (it ranks
    a row's passages against each other)."""
    for ex in examples:
        outside = [x for x in ex.labels if not 0.0 <= x <= 1.0]
        if loss == "bce" and outside:
            raise UserError(f"{ex.source}: label {outside[0]:g}: --rerank_loss bce (BinaryCrossEntropyLoss) takes "
                            f"labels from 0 to 1; graded labels rank with --rerank_loss lambda")
        if loss == "mnrl" and not (ex.labels[0] > 0 and not any(ex.labels[1:])):
            raise UserError(f"{ex.source}: labels {', '.join(f'{x:g}' for x in ex.labels)}: --rerank_loss mnrl "
                            f"(MultipleNegativesRankingLoss) takes a positive and optional negatives per row: query, "
                            f"positive, negatives")
    if loss == "lambda" and examples and all(len(ex.candidates) == 1 for ex in examples):
        raise UserError("--rerank_loss lambda (LambdaLoss) ranks each row's passages against each other, and every "
                        "training row has one; give rows of query, passages and labels, or of query, positive and "
                        "negatives")


def tokenize_pairs(tokenizer: PreTrainedTokenizerBase, queries: Sequence[str], passages: Sequence[str],
                   max_length: int) -> BatchEncoding:
    """(query, passage) pairs encoded together as sentence-transformers' CrossEncoder encodes them: the tokenizer's
    own pair template, cut longest first to max_length, padded to the longest on the tokenizer's side."""
    return tokenizer(list(queries), list(passages), padding=True, truncation="longest_first", max_length=max_length,
                     return_tensors="pt")


def in_batch_negatives(examples: Sequence[Example], k: int, generator: torch.Generator | None = None) -> list[list[str]]:
    """For each row, k passages of the batch's other rows (-1: all), drawn as sentence-transformers' MNRL for
    cross-encoders draws them: from the batch's passages taken column by column (every row's first passage, then
    every row's second, ...), the row's own left out, k without replacement (torch.multinomial), all of them where k
    is not below their number. A passage of a row with the same query, or with the text of one of the row's own, is
    no negative of it and is left out too (the fewest such a row keeps bounds k)."""
    width = max(len(ex.candidates) for ex in examples)
    pool = [(j, ex.candidates[c]) for c in range(width) for j, ex in enumerate(examples) if c < len(ex.candidates)]
    valid = torch.tensor([[j != i and examples[j].prompt != ex.prompt and text not in ex.candidates
                           for j, text in pool] for i, ex in enumerate(examples)])
    if k < 0 or k >= int(valid.sum(1).min()):
        chosen = [row.nonzero().flatten().tolist() for row in valid]
    else:
        chosen = torch.multinomial(valid.float(), k, generator=generator).tolist()
    return [[pool[p][1] for p in row] for row in chosen]


def collate_rerank(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                   num_negatives: int = 0, generator: torch.Generator | None = None) -> RerankBatch:
    """The pairs of a batch: each query with its own passages, then (num_negatives not 0) passages of the other rows
    as its extra negatives, labelled 0 (`in_batch_negatives`); each query's weight 1."""
    extra = in_batch_negatives(examples, num_negatives, generator) if num_negatives else [[] for _ in examples]
    rows = [(i, ex.prompt, passage, label) for i, ex in enumerate(examples)
            for passage, label in [*zip(ex.candidates, ex.labels, strict=True), *((p, 0.0) for p in extra[i])]]
    encoded = tokenize_pairs(tokenizer, [r[1] for r in rows], [r[2] for r in rows], max_length)
    return RerankBatch(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                       token_type_ids=encoded.get("token_type_ids"), group=torch.tensor([r[0] for r in rows]),
                       label=torch.tensor([r[3] for r in rows], dtype=torch.float32),
                       weight=torch.ones(len(examples)))
