"""Training and scoring batches, one class per kind; each knows its examples, how to split and double itself.

- `TokenBatch`: left-padded rows, one per example; the scored tokens sit in the last `target_mask.shape[1]` columns.
- `CandidateBatch`: a `TokenBatch` whose rows are every candidate of each example, for cross-entropy over them.
- `PackedBatch`: the examples end to end in one row, positions restarting at 0 (no padding, no attention mask).
- `LabelBatch`: right-padded inputs of a classifier or masked-LM head, with a gold label each.
- `PairBatch`: right-padded queries and their documents (a positive, then hard negatives), for a contrastive loss.
- `GritBatch`: a `PairBatch` and a `TokenBatch` of instruction data, trained together (GRIT).
- `PreferenceBatch`: each prompt once and its completions: chosen and rejected (DPO), or one completion with its
  label and a mismatched one for the KL estimate (KTO).
- `RewardBatch`: preference pairs as whole right-padded sequences, chosen rows then rejected rows (reward models).
- `RerankBatch`: (query, passage) pairs tokenised together, grouped by query, with a relevance label each (a
  cross-encoder reranker).

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

    def n_tokens(self) -> int:
        """Non-padding input tokens (a host sync; packed batches have no padding and no mask)."""
        mask = getattr(self, "attention_mask", None)
        return int(mask.sum()) if mask is not None else self.input_ids.numel()

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


@dataclass(kw_only=True)
class PairBatch(Batch):
    """Right-padded queries [B, Lq] and documents [D, Ld]: each example's positive then its hard negatives, adjacent.

    positive [B]: the row of each query's positive among the documents; doc_key [D]: an id of each document's text,
    so that another query's copy of a positive is not counted as a negative. `halves` is 2 in MeZO's dual batch:
    two independent contrastive batches (rows [:n] and [n:] of queries and documents), scored apart. The
    contrastive loss of a query depends on every document of its batch, so split() keeps the query's own documents
    only (fewer in-batch negatives: a micro-batch is a smaller contrastive batch).
    """

    query_ids: Tensor
    query_mask: Tensor
    doc_ids: Tensor
    doc_mask: Tensor
    doc_group: Tensor
    positive: Tensor
    doc_key: Tensor
    halves: int = 1

    @property
    def n_examples(self) -> int:
        """Queries (of one half)."""
        return self.positive.shape[0]

    def n_tokens(self) -> int:
        """Non-padding tokens of queries and documents."""
        return int(self.query_mask.sum() + self.doc_mask.sum())

    def split(self: B, start: int, stop: int) -> B:
        """Queries start..stop-1 with their own documents, rows renumbered from 0."""
        if self.halves != 1:
            raise ValueError("a doubled pair batch is not split")
        rows = (self.doc_group >= start) & (self.doc_group < stop)
        first = int(rows.nonzero()[0]) if rows.any() else 0
        return dataclasses.replace(
            self, query_ids=self.query_ids[start:stop], query_mask=self.query_mask[start:stop],
            doc_ids=self.doc_ids[rows], doc_mask=self.doc_mask[rows], doc_group=self.doc_group[rows] - start,
            positive=self.positive[start:stop] - first, doc_key=self.doc_key[rows])

    def doubled(self: B) -> B:
        """Queries and documents twice (two model inputs, each split in halves by the dual adapters); the index
        tensors stay those of one half."""
        twice = lambda t: torch.cat([t, t])  # noqa: E731
        return dataclasses.replace(self, query_ids=twice(self.query_ids), query_mask=twice(self.query_mask),
                                   doc_ids=twice(self.doc_ids), doc_mask=twice(self.doc_mask), halves=2)


@dataclass(kw_only=True)
class RerankBatch(Batch):
    """(query, passage) pairs, one right-padded row each [P, L] (token_type_ids where the tokenizer gives them),
    grouped by query: group [P] maps a row to its query (rows of one query adjacent, its first row its positive
    where the loss reads one), label [P] is the row's relevance label, weight [G] each query's share of the batch's
    loss (so that the mean over queries is sentence-transformers' mean over the batch). `halves` is 2 in MeZO's
    dual batch: the rows twice, the index tensors those of one half."""

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor | None = None
    group: Tensor
    label: Tensor
    weight: Tensor
    halves: int = 1

    @property
    def n_examples(self) -> int:
        """Queries (of one half)."""
        return self.weight.shape[0]

    def split(self: B, start: int, stop: int) -> B:
        """Queries start..stop-1 with their rows, renumbered from 0 (each query's loss reads its own rows only)."""
        if self.halves != 1:
            raise ValueError("a doubled rerank batch is not split")
        rows = (self.group >= start) & (self.group < stop)
        types = None if self.token_type_ids is None else self.token_type_ids[rows]
        return dataclasses.replace(self, input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
                                   token_type_ids=types, group=self.group[rows] - start, label=self.label[rows],
                                   weight=self.weight[start:stop])

    def doubled(self: B) -> B:
        """The rows twice (one model input, split in halves by the dual adapters); the index tensors stay one
        half's."""
        twice = lambda t: None if t is None else torch.cat([t, t])  # noqa: E731
        return dataclasses.replace(self, input_ids=twice(self.input_ids), attention_mask=twice(self.attention_mask),
                                   token_type_ids=twice(self.token_type_ids), halves=2)


@dataclass(kw_only=True)
class GritBatch(Batch):
    """GRIT: a contrastive batch and a generative (instruction) batch, one training step on both.

    Its examples are the pairs'; the generative rows are as many or fewer, drawn beside them.
    """

    pairs: PairBatch
    generative: TokenBatch

    @property
    def n_examples(self) -> int:
        """The pair examples."""
        return self.pairs.n_examples

    def n_tokens(self) -> int:
        """Tokens of both batches."""
        return self.pairs.n_tokens() + self.generative.n_tokens()

    def split(self: B, start: int, stop: int) -> B:
        """Not split: a GRIT step's two losses need their whole batches (raise the batch size per device instead)."""
        raise ValueError("a GRIT batch is not split into micro-batches")

    def doubled(self: B) -> B:
        """Both batches doubled."""
        return dataclasses.replace(self, pairs=self.pairs.doubled(), generative=self.generative.doubled())

    def to(self: B, device: torch.device) -> B:
        """Both batches on device."""
        return dataclasses.replace(self, pairs=self.pairs.to(device), generative=self.generative.to(device))


@dataclass(kw_only=True)
class PreferenceBatch(Batch):
    """Completions sharing their prompt: prompt_ids / prompt_mask [P, Wp] left-padded, one row per prompt;
    completion_ids / completion_mask [kP, Wc] right-padded in k blocks of P rows, block j holding each prompt's j-th
    completion (DPO: the P chosen completions, then the P rejected ones; KTO: the P completions, then, where the loss
    estimates the KL term, each prompt's mismatched completion); ref_logps [kP] the reference's summed completion
    log-probabilities in the same order (None: the loss computes them); label [P] whether each completion is
    desirable (KTO; None for pairs). `halves` is 2 in MeZO's dual batch: every tensor twice, rows [:n] and [n:] of
    each scored apart."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    ref_logps: Tensor | None = None
    label: Tensor | None = None
    halves: int = 1

    @property
    def n_examples(self) -> int:
        """Prompts (of one half): pairs, or KTO's rows."""
        return self.prompt_ids.shape[0] // self.halves

    @property
    def completions_per_prompt(self) -> int:
        """k: the blocks of completion rows."""
        return self.completion_ids.shape[0] // self.prompt_ids.shape[0]

    def n_tokens(self) -> int:
        """Non-padding tokens: each prompt once, and every completion."""
        return int(self.prompt_mask.sum() + self.completion_mask.sum())

    def split(self: B, start: int, stop: int) -> B:
        """Prompts start..stop-1: their rows in every block, their labels."""
        if self.halves != 1:
            raise ValueError("a doubled preference batch is not split")
        n = self.n_examples
        rows = torch.cat([torch.arange(j * n + start, j * n + stop) for j in range(self.completions_per_prompt)])
        rows = rows.to(self.completion_ids.device)
        return dataclasses.replace(
            self, prompt_ids=self.prompt_ids[start:stop], prompt_mask=self.prompt_mask[start:stop],
            completion_ids=self.completion_ids[rows], completion_mask=self.completion_mask[rows],
            ref_logps=None if self.ref_logps is None else self.ref_logps[rows],
            label=None if self.label is None else self.label[start:stop])

    def doubled(self: B) -> B:
        """Every tensor twice: rows [:n] of each are the first half (its blocks in order), [n:] the copy."""
        return dataclasses.replace(super().doubled(), halves=2)


@dataclass(kw_only=True)
class RewardBatch(Batch):
    """Preference pairs as a reward model reads them (TRL's DataCollatorForPreference): input_ids / attention_mask
    [2P, W] right-padded, prompt + chosen for the P pairs, then prompt + rejected; margin [P], each pair's margin
    column (None: the rows have none). `halves` is 2 in MeZO's dual batch: every tensor twice, rows [:n] and [n:] of
    each scored apart.

    Where the batch's pairs share a prompt (`collate_rewards(shared=True)`), the same tokens also split at it, as a
    `PreferenceBatch` holds them: prompt_ids / prompt_mask [P, Wp] each pair's shared beginning, left-padded, and
    completion_ids / completion_mask [2P, Wc] the rest of each sequence (chosen rows, then rejected), right-padded;
    None otherwise."""

    input_ids: Tensor
    attention_mask: Tensor
    margin: Tensor | None = None
    prompt_ids: Tensor | None = None
    prompt_mask: Tensor | None = None
    completion_ids: Tensor | None = None
    completion_mask: Tensor | None = None
    halves: int = 1

    @property
    def n_examples(self) -> int:
        """Pairs (of one half)."""
        return self.input_ids.shape[0] // (2 * self.halves)

    def n_tokens(self) -> int:
        """Non-padding tokens: each shared prompt once, where the batch has them, and every completion."""
        if self.prompt_mask is None:
            return super().n_tokens()
        return int(self.prompt_mask.sum() + self.completion_mask.sum())

    def split(self: B, start: int, stop: int) -> B:
        """Pairs start..stop-1: their chosen and rejected rows, prompts and margins."""
        if self.halves != 1:
            raise ValueError("a doubled reward batch is not split")
        n = self.n_examples
        rows = torch.cat([torch.arange(start, stop), torch.arange(n + start, n + stop)]).to(self.input_ids.device)

        def pick(t: Tensor | None, index: Tensor | slice) -> Tensor | None:
            return None if t is None else t[index]

        return dataclasses.replace(
            self, input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
            margin=pick(self.margin, slice(start, stop)), prompt_ids=pick(self.prompt_ids, slice(start, stop)),
            prompt_mask=pick(self.prompt_mask, slice(start, stop)), completion_ids=pick(self.completion_ids, rows),
            completion_mask=pick(self.completion_mask, rows))

    def doubled(self: B) -> B:
        """Every tensor twice: rows [:n] of each are the first half (chosen then rejected), [n:] the copy."""
        return dataclasses.replace(super().doubled(), halves=2)
