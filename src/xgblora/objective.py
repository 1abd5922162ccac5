"""Training objectives as MeZO defines them: loss on the gold candidate's tokens, or cross-entropy over candidates."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xgblora.data.batching import TokenSeq, collate, target_logprobs


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

    Without a "group" entry: the mean negative log-likelihood of each row's target tokens (the gold candidate or
    the response). With one (classification): cross-entropy over each example's candidates, scored by their mean
    token log-probability, against the batch's "gold" candidate index of each example.
    """
    logprobs = target_logprobs(model, batch)
    mean_lp = logprobs.sum(-1) / batch["target_mask"].sum(-1)
    if "group" not in batch:
        return -mean_lp
    group, candidate = batch["group"], batch["candidate"]
    n_groups = int(group.max()) + 1
    scores = mean_lp.new_full((n_groups, int(candidate.max()) + 1), float("-inf"))
    scores[group, candidate] = mean_lp
    return torch.nn.functional.cross_entropy(scores, batch["gold"], reduction="none")
