"""Training sets and the loss of each batch kind: the gold continuation's tokens, cross-entropy over candidates
(MeZO's classification objective), over a label head's labels, InfoNCE over query/document pairs (contrastive),
InfoNCE plus the instruction loss (GRIT), a cross-encoder's loss over (query, passage) pairs (rerank), or a
preference loss over pairs (DPO's, or a reward model's)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from xgblora.data.batches import (
    Batch,
    CandidateBatch,
    GritBatch,
    LabelBatch,
    PackedBatch,
    PairBatch,
    PreferenceBatch,
    RerankBatch,
    RewardBatch,
    TokenBatch,
)
from xgblora.data.collation import TokenSeq, collate, collate_packed, training_seqs
from xgblora.data.labels import LabelScoring, collate_labels, encode_labels
from xgblora.data.pairs import PairSeq, collate_pairs
from xgblora.data.rerank import collate_rerank, tokenize_pairs
from xgblora.data.tasks import Example
from xgblora.embeddings.contrastive import Contrastive
from xgblora.embeddings.rerank import Reranker
from xgblora.models.scoring import label_logits, packed_mean_logprobs, target_logprobs
from xgblora.preference.kto import KTOLoss
from xgblora.preference.reward import RewardLoss
from xgblora.preference.scoring import PreferenceLoss


@dataclass
class TrainingSet:
    """The tokenised training examples: each one's length (for length grouping) and how to batch a list of them."""

    lengths: list[int]
    batch: Callable[[Sequence[int]], Batch]


def causal_training_set(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                        classification: bool, packed: bool = False, token_mean: bool = False,
                        whole_sequence: bool = False, pad_to_multiple_of: int = 1) -> TrainingSet:
    """A causal LM's training set: the gold continuation of each example, or all its candidates (classification).

    packed: each batch is its examples end to end in one row, without padding (`batching.collate_packed`).
    whole_sequence: every token after the first carries loss, the prompt's too (MeZO's only_train_option=False).
    """
    seqs = training_seqs(tokenizer, examples, max_length, all_candidates=classification)
    if whole_sequence:
        seqs = [dataclasses.replace(s, n_target=len(s.ids) - 1) for s in seqs]
    if not classification:
        return sequence_training_set(seqs, tokenizer.pad_token_id, packed, token_mean, pad_to_multiple_of)
    if packed:
        raise ValueError("packed batches hold one sequence per example: not the classification objective")
    by_example: dict[int, list[int]] = {}
    for row, s in enumerate(seqs):
        by_example.setdefault(s.example, []).append(row)
    lengths = [max(len(seqs[r].ids) for r in by_example[e]) for e in range(len(examples))]
    golds = [ex.gold[0] for ex in examples]
    return TrainingSet(lengths, lambda idx: make_batch(seqs, idx, tokenizer.pad_token_id, by_example, golds))


def sequence_training_set(seqs: Sequence[TokenSeq], pad_id: int, packed: bool = False,
                          token_mean: bool = False, pad_to_multiple_of: int = 1) -> TrainingSet:
    """A training set of one scored sequence per example, batched padded (widths rounded up to pad_to_multiple_of)
    or packed; token_mean: a batch's loss is the mean over its target tokens, else the mean of each example's
    mean."""
    lengths = [len(s.ids) for s in seqs]
    if packed:
        return TrainingSet(lengths, lambda idx: collate_packed([seqs[i] for i in idx], token_mean))

    def batch(idx: Sequence[int]) -> TokenBatch:
        padded = collate([seqs[i] for i in idx], pad_id, pad_to_multiple_of)
        return padded.token_mean() if token_mean else padded

    return TrainingSet(lengths, batch)


def label_training_set(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                       scoring: LabelScoring) -> TrainingSet:
    """A classifier's or masked LM's training set: each example's prompt and gold label."""
    seqs = encode_labels(tokenizer, examples, max_length, scoring)
    return TrainingSet([len(s.ids) for s in seqs],
                       lambda idx: collate_labels([seqs[i] for i in idx], tokenizer.pad_token_id, scoring))


def pair_training_set(seqs: Sequence[PairSeq], pad_id: int) -> TrainingSet:
    """A contrastive training set: each pair's query and documents (grouped by the length of its positive)."""
    return TrainingSet([len(s.docs[0]) for s in seqs], lambda idx: collate_pairs([seqs[i] for i in idx], pad_id))


def rerank_training_set(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                        reranker: Reranker, seed: int) -> TrainingSet:
    """A reranker's training set: each row's (query, passage) pairs (grouped by the length of its first pair), with
    MNRL's in-batch negatives drawn per batch from a generator seeded by the run's seed and the batch's rows (the
    same draw on a resumed run), and each query's weight in the batch's loss."""
    lengths = tokenize_pairs(tokenizer, [ex.prompt for ex in examples], [ex.candidates[0] for ex in examples],
                             max_length)["attention_mask"].sum(1).tolist() if examples else []

    def batch(idx: Sequence[int]) -> RerankBatch:
        digest = hashlib.blake2b(repr((seed, list(idx))).encode(), digest_size=8).digest()
        draws = torch.Generator().manual_seed(int.from_bytes(digest, "big") >> 1)
        pairs = collate_rerank(tokenizer, [examples[i] for i in idx], max_length, reranker.num_negatives, draws)
        return dataclasses.replace(pairs, weight=reranker.weights(pairs))

    return TrainingSet(lengths, batch)


def grit_training_set(pairs: Sequence[PairSeq], generative: TrainingSet, pad_id: int,
                      generative_batch: int | None = None) -> TrainingSet:
    """GRIT: example k of an epoch is pair k mod P and instruction example k mod G, so an epoch covers the larger of
    the two sets once and the smaller one over again; a batch holds both, its generative part the instruction
    examples of its first `generative_batch` indices (GritLM's per_device_generative_bs; default all)."""
    n = max(len(pairs), len(generative.lengths))

    def batch(idx: Sequence[int]) -> GritBatch:
        return GritBatch(pairs=collate_pairs([pairs[k % len(pairs)] for k in idx], pad_id),
                         generative=generative.batch([k % len(generative.lengths) for k in idx[:generative_batch]]))

    return TrainingSet([len(pairs[k % len(pairs)].docs[0]) for k in range(n)], batch)


def make_batch(seqs: Sequence[TokenSeq], examples: Sequence[int], pad_id: int, by_example: dict[int, list[int]],
               golds: Sequence[int]) -> CandidateBatch:
    """Collate every candidate sequence of the given examples, grouped by example, for cross-entropy over them.

    `by_example` maps an example index to the indices of its sequences in `seqs`; `golds` gives each example's
    gold candidate index.
    """
    rows = [r for e in examples for r in by_example[e]]
    batch = collate([seqs[r] for r in rows], pad_id)
    return CandidateBatch(**vars(batch), group=torch.tensor([k for k, e in enumerate(examples) for _ in by_example[e]]),
                          candidate=torch.tensor([seqs[r].candidate for r in rows]),
                          gold=torch.tensor([golds[e] for e in examples]))


# the losses of preference batches: DPO's family, KTO's, a reward model's; each keeps TRL's statistics
PairLoss = PreferenceLoss | KTOLoss | RewardLoss


@dataclass
class TrainingLoss:
    """The training forward: per-example losses of a batch under the run's autocast. `model` is what runs (compiled
    or wrapped by FSDP); the steppers call this object."""

    model: torch.nn.Module
    autocast: torch.dtype | None = None
    contrastive: Contrastive | None = None
    preference: PairLoss | None = None
    fused_head: bool = False
    reranker: Reranker | None = None

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Per-example losses [n_examples] (times the batch's loss_scale)."""
        if self.autocast is None:
            return per_example_loss(self.model, batch, self.contrastive, self.preference, self.fused_head,
                                    self.reranker)
        device = next(self.model.parameters()).device
        with torch.autocast(device.type, dtype=self.autocast):
            return per_example_loss(self.model, batch, self.contrastive, self.preference, self.fused_head,
                                    self.reranker)

    def head_loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The mean loss of a new classification head's outputs [forwards x rows, outputs], the outputs of every
        forward MeZO ran on the batch (a doubled batch's too) stacked: cross-entropy over a label head's labels, a
        reranker's loss of its pair logits, a reward model's of its pairs' rewards (what `train.head.HeadTrainer`
        trains the head on)."""
        if logits.dim() == 3:  # a causal LM's score head runs on every position; its forward reads the last token's
            ids = batch.input_ids.repeat(logits.shape[0] // batch.input_ids.shape[0], 1)
            real = (ids != self.model.config.pad_token_id) * torch.arange(ids.shape[1], device=ids.device)
            logits = logits[torch.arange(ids.shape[0], device=ids.device), real.argmax(-1)]
        if isinstance(batch, RewardBatch):
            forwards = logits.shape[0] // batch.input_ids.shape[0]
            return torch.stack([self.preference.losses(rewards, batch).mean()
                                for rewards in logits[:, 0].float().chunk(forwards)]).mean()
        if isinstance(batch, RerankBatch):
            forwards = logits.shape[0] // batch.label.shape[0]
            return torch.stack([self.reranker.from_scores(scores, batch).mean()
                                for scores in logits[:, 0].float().chunk(forwards)]).mean() * batch.loss_scale
        labels = batch.labels.repeat(logits.shape[0] // batch.labels.shape[0])  # each forward saw the batch
        return torch.nn.functional.cross_entropy(logits.float().reshape(labels.shape[0], -1), labels) * batch.loss_scale

    def metrics(self) -> dict[str, float]:
        """This process's statistics of the losses since the last call, for the logs: DPO's rewards and
        log-probabilities (`PreferenceLoss`), KTO's and its KL estimate (`KTOLoss`), a reward model's accuracy and
        rewards (`RewardLoss`); none for the other batch kinds."""
        return self.preference.statistics.drain() if self.preference is not None else {}


def per_example_loss(model: torch.nn.Module, batch: Batch, contrastive: Contrastive | None = None,
                     preference: PairLoss | None = None, fused_head: bool = False,
                     reranker: Reranker | None = None) -> torch.Tensor:
    """Loss of each example in the batch, shape [n_examples], times the batch's loss_scale.

    TokenBatch / PackedBatch: the mean negative log-likelihood of each example's target tokens (the gold candidate
    or the response), or with token-mean weights its summed NLL times n / (the batch's target tokens), so that the
    mean over examples is the mean over the batch's tokens. CandidateBatch: cross-entropy over each example's candidates, scored by their mean token
    log-probability. LabelBatch (a classifier or masked LM): cross-entropy over the label logits. PairBatch: each
    query's InfoNCE term (`Contrastive`); GritBatch: w_c times that plus w_g times the generative batch's mean loss.
    PreferenceBatch: each pair's or row's preference loss (`PreferenceLoss`: DPO and its family; `KTOLoss`; they
    apply loss_scale); RewardBatch: each pair's reward-model loss (`RewardLoss`; it applies loss_scale).
    RerankBatch: each query's share of a cross-encoder's loss over its (query, passage) pairs (`Reranker`).
    fused_head: TokenBatch and PackedBatch (GRIT's generative part too) score their targets through the fused LM
    head (`models.fused_head`: no [tokens, vocab] logits) where the model allows it.
    """
    match batch:
        case PreferenceBatch() | RewardBatch():
            return preference(model, batch)
        case GritBatch():
            losses = contrastive.grit(model, batch, per_example_loss(model, batch.generative, fused_head=fused_head))
        case PairBatch():
            losses = contrastive(model, batch)
        case RerankBatch():
            losses = reranker(model, batch)
        case LabelBatch():
            losses = torch.nn.functional.cross_entropy(label_logits(model, batch), batch.labels, reduction="none")
        case PackedBatch():
            losses = -packed_mean_logprobs(model, batch, fused_head)
        case CandidateBatch():
            losses = candidate_loss(model, batch)
        case TokenBatch():
            nll = -target_logprobs(model, batch, fused_head).sum(-1)
            losses = nll / batch.target_mask.sum(-1) if batch.nll_weight is None else nll * batch.nll_weight
        case _:
            raise TypeError(f"no loss for a batch of type {type(batch).__name__}")
    return losses if batch.loss_scale == 1.0 else losses * batch.loss_scale  # one process: no extra kernel


def candidate_loss(model: torch.nn.Module, batch: CandidateBatch) -> torch.Tensor:
    """Cross-entropy over each example's candidates, scored by their mean token log-probability, shape [n]."""
    mean_lp = target_logprobs(model, batch).sum(-1) / batch.target_mask.sum(-1)
    scores = mean_lp.new_full((batch.n_examples, int(batch.candidate.max()) + 1), float("-inf"))
    scores[batch.group, batch.candidate] = mean_lp
    return torch.nn.functional.cross_entropy(scores, batch.gold, reduction="none")
