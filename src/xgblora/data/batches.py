"""Training and scoring batches, one class per kind; each knows its examples, how to split and double itself.

- `TokenBatch`: left-padded rows, one per example; the scored tokens sit in the last `target_mask.shape[1]` columns.
- `CandidateBatch`: a `TokenBatch` whose rows are every candidate of each example, for cross-entropy over them.
- `PackedBatch`: the examples end to end in one row, positions restarting at 0 (no padding, no attention mask).
- `LabelBatch`: right-padded inputs of a classifier or masked-LM head, with a gold label each.

Every batch carries `loss_scale`, the share of a data-parallel global batch that this process's shard stands for
(1.0 with one process): the objective multiplies each example's loss by it, so a plain mean over processes is the
mean over the global batch. `split` keeps it, so a micro-batch of a shard is weighted as its shard is.
`doubled()` is MeZO's dual batch: the batch followed by a copy of itself, rows [:n] and [n:] scored apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

B = TypeVar("B", bound="Batch")


@dataclass(kw_only=True)
class Batch:
    """What every batch kind offers; subclasses hold the tensors (the fields not named `loss_scale`)."""

    loss_scale: float = 1.0

    @property
    def n_examples(self) -> int:
        """Examples in the batch (rows of a padded batch, sequences of a packed one, candidate groups)."""
        raise NotImplementedError

    def split(self: B, start: int, stop: int) -> B:
        """The batch of examples start..stop-1."""
        raise NotImplementedError

    def doubled(self: B) -> B:
        """The batch followed by a copy of itself (MeZO's dual batch): every tensor concatenated with itself."""
        return self._map(lambda t: torch.cat([t, t]))

    def to(self: B, device: torch.device) -> B:
        """The same batch on `device` (non-blocking copies)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def _map(self: B, fn) -> B:
        changes = {f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **changes)


@dataclass(kw_only=True)
class RowBatch(Batch):
    """A batch with one example per row of input_ids."""

    @property
    def n_examples(self) -> int:
        """One example per row."""
        return self.input_ids.shape[0]

    def split(self: B, start: int, stop: int) -> B:
        """Rows start..stop-1."""
        return self._map(lambda t: t[start:stop])


@dataclass(kw_only=True)
class TokenBatch(RowBatch):
    """Left-padded token rows; target_mask [rows, k] marks the scored tokens among the last k columns.

    nll_weight [rows] weighs each row's summed target negative log-likelihood in its loss; None means one over its
    target count (each example's mean). `token_mean()` sets it so the mean over rows is the mean over all tokens.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    target_mask: Tensor
    nll_weight: Tensor | None = None

    def token_mean(self: B) -> B:
        """The batch whose loss is the mean over all its scored tokens: each row's weight n_rows / n_tokens.

        A split keeps these weights, so the micro-batches of a batch, weighted by their share of its rows, add up
        to the same token mean.
        """
        n_tokens = self.target_mask.sum()
        weight = torch.full((self.n_examples,), self.n_examples, dtype=torch.float32) / n_tokens
        return dataclasses.replace(self, nll_weight=weight)


@dataclass(kw_only=True)
class CandidateBatch(TokenBatch):
    """Every candidate of each example as a row: `group` maps a row to its example (rows of one example are
    adjacent), `candidate` to its index among the example's candidates; `gold` is each example's gold index."""

    group: Tensor
    candidate: Tensor
    gold: Tensor

    @property
    def n_examples(self) -> int:
        """One example per group of candidate rows."""
        return self.gold.shape[0]

    def split(self: B, start: int, stop: int) -> B:
        """The rows of examples start..stop-1, their groups renumbered from 0."""
        rows = (self.group >= start) & (self.group < stop)
        return dataclasses.replace(
            self, input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
            position_ids=self.position_ids[rows], target_mask=self.target_mask[rows], group=self.group[rows] - start,
            candidate=self.candidate[rows], gold=self.gold[start:stop])

    def doubled(self: B) -> B:
        """The copy's groups follow the original's, so its examples are n..2n-1."""
        twice = super().doubled()
        return dataclasses.replace(twice, group=torch.cat([self.group, self.group + self.n_examples]))


@dataclass(kw_only=True)
class PackedBatch(Batch):
    """Sequences end to end in one row [1, T]; target_index [1, K] holds the positions whose logits predict the K
    scored tokens; target_weight [1, n, K] is 1 / n_target where target k belongs to sequence i, so
    target_weight @ log-probs gives each sequence's mean target log-probability. doubled() makes two rows."""

    input_ids: Tensor
    position_ids: Tensor
    target_index: Tensor
    target_weight: Tensor

    @property
    def n_examples(self) -> int:
        """Sequences per row."""
        return self.target_weight.shape[1]

    def split(self: B, start: int, stop: int) -> B:
        """Sequences start..stop-1 (their tokens are one contiguous slice of the row)."""
        starts = [*(self.position_ids[0] == 0).nonzero().flatten().tolist(), self.input_ids.shape[1]]
        first, last = starts[start], starts[stop]
        keep = (self.target_index[0] >= first) & (self.target_index[0] < last)
        return dataclasses.replace(
            self, input_ids=self.input_ids[:, first:last], position_ids=self.position_ids[:, first:last],
            target_index=self.target_index[:, keep] - first, target_weight=self.target_weight[:, start:stop][:, :, keep])


@dataclass(kw_only=True)
class LabelBatch(RowBatch):
    """Right-padded inputs and gold labels of a label head; a masked-LM head adds, per row, the mask token's
    position and the label words' token ids (per row, so that the dual batch doubles them too); a classifier
    head reads the representation named by `pooling` (see `scoring.pool`)."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    mask_pos: Tensor | None = None
    label_token_ids: Tensor | None = None
    pooling: str = "cls"
