"""Training objectives: loss on the gold candidate's tokens, cross-entropy over candidates (MeZO), or over labels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from xgblora import encoders
from xgblora.data.batching import (
    TokenSeq,
    collate,
    collate_packed,
    packed_mean_logprobs,
    target_logprobs,
    training_seqs,
)
from xgblora.data.tasks import Example


@dataclass
class TrainingSet:
    """The tokenised training examples: each one's length (for length grouping) and how to batch a list of them."""

    lengths: list[int]
    batch: Callable[[Sequence[int]], dict[str, torch.Tensor]]


def causal_training_set(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                        classification: bool, packed: bool = False) -> TrainingSet:
    """A causal LM's training set: the gold continuation of each example, or all its candidates (classification).

    packed: each batch is its examples end to end in one row, without padding (`batching.collate_packed`).
    """
    seqs = training_seqs(tokenizer, examples, max_length, all_candidates=classification)
    if packed:
        if classification:
            raise ValueError("packed batches hold one sequence per example: not the classification objective")
        return TrainingSet([len(s.ids) for s in seqs], lambda idx: collate_packed([seqs[i] for i in idx]))
    by_example: dict[int, list[int]] = {}
    for row, s in enumerate(seqs):
        by_example.setdefault(s.example, []).append(row)
    lengths = [max(len(seqs[r].ids) for r in by_example[e]) for e in range(len(examples))]
    golds = [ex.gold[0] for ex in examples] if classification else None
    return TrainingSet(lengths, lambda idx: make_batch(seqs, idx, tokenizer.pad_token_id, by_example, golds))


def label_training_set(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                       scoring: encoders.LabelScoring) -> TrainingSet:
    """A classifier's or masked LM's training set: each example's prompt and gold label."""
    seqs = encoders.encode(tokenizer, examples, max_length, scoring)
    return TrainingSet([len(s.ids) for s in seqs],
                       lambda idx: encoders.collate([seqs[i] for i in idx], tokenizer.pad_token_id, scoring))


def make_batch(seqs: Sequence[TokenSeq], examples: Sequence[int], pad_id: int, by_example: dict[int, list[int]],
               golds: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Collate the sequences of the given examples; for classification (golds given) add their grouping.

    `by_example` maps an example index to the indices of its sequences in `seqs`; `golds` gives each example's
    gold candidate index when the objective is cross-entropy over candidates (whatever this batch holds).
    """
    rows = [r for e in examples for r in by_example[e]]
    batch = collate([seqs[r] for r in rows], pad_id)
    if golds is not None:
        batch["group"] = torch.tensor([k for k, e in enumerate(examples) for _ in by_example[e]])
        batch["candidate"] = torch.tensor([seqs[r].candidate for r in rows])
        batch["gold"] = torch.tensor([golds[e] for e in examples])
    return batch


def per_example_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Loss of each example in the batch, shape [n_examples].

    Without a "group" entry: the mean negative log-likelihood of each example's target tokens (the gold candidate
    or the response), padded or packed. With one (classification): cross-entropy over each example's candidates,
    scored by their mean token log-probability, against the batch's "gold" candidate index of each example. With
    "labels" (a classifier or masked LM): cross-entropy over the label logits.
    """
    if "labels" in batch:
        return encoders.label_loss(model, batch)
    if "target_index" in batch:
        return -packed_mean_logprobs(model, batch)
    logprobs = target_logprobs(model, batch)
    mean_lp = logprobs.sum(-1) / batch["target_mask"].sum(-1)
    if "group" not in batch:
        return -mean_lp
    group, candidate = batch["group"], batch["candidate"]
    n_groups = int(group.max()) + 1
    scores = mean_lp.new_full((n_groups, int(candidate.max()) + 1), float("-inf"))
    scores[group, candidate] = mean_lp
    return torch.nn.functional.cross_entropy(scores, batch["gold"], reduction="none")
