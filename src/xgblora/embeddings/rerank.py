"""A cross-encoder reranker's scores and losses, as sentence-transformers' CrossEncoder computes them: one logit per
(query, passage) pair from the model's own sequence-classification head (one output); BinaryCrossEntropyLoss on
each pair's label, MultipleNegativesRankingLoss for cross-encoders (each query's positive against its negatives, on
scale x sigmoid(logit)) and LambdaLoss (each query's passages ranked by their labels, with its weighting schemes).
Each loss is computed per query and weighted (`Reranker.weights`) so that the mean over a batch's queries is
sentence-transformers' loss of the batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from xgblora.data.batches import RerankBatch
from xgblora.data.rerank import tokenize_pairs
from xgblora.models.scoring import eval_mode

MNRL_SCALE = 10.0  # sentence-transformers' MultipleNegativesRankingLoss for cross-encoders: scale x sigmoid(logit)
# LambdaLoss's defaults: NDCGLoss2++'s mu, the sigmoid's sigma, the floor of the ideal DCG; all documents count (k
# None) and the logarithm is binary
LAMBDA_MU, LAMBDA_SIGMA, LAMBDA_EPS = 10.0, 1.0, 1e-10
PADDED_LOGIT = -1e16  # LambdaLoss's logit of a query's missing documents (below every real one)


def pair_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                token_type_ids: Tensor | None = None) -> Tensor:
    """The logit of each encoded pair [P] (fp32): the model's sequence-classification head, its one output."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        inputs["token_type_ids"] = token_type_ids
    return model(**inputs).logits[:, 0].float()


@torch.no_grad()
def score_pairs(model: nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[tuple[str, str]],
                max_length: int, batch_size: int = 32) -> Tensor:
    """sigmoid(logit) of each (query, passage) pair [N], what CrossEncoder.predict gives for a one-output model (its
    default activation), in eval mode, the longest pairs batched first."""
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    device = next(model.parameters()).device
    out = torch.empty(len(pairs))
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            encoded = tokenize_pairs(tokenizer, [pairs[i][0] for i in chunk], [pairs[i][1] for i in chunk],
                                     max_length).to(device)
            out[chunk] = torch.sigmoid(pair_logits(model, **encoded)).cpu()
    return out


def by_query(values: Tensor, group: Tensor, n_queries: int, fill: float) -> Tensor:
    """Row values [P] of adjacent query groups as a matrix [queries, the most rows of one], `fill` past a query's
    rows."""
    counts = torch.bincount(group, minlength=n_queries)
    slot = torch.arange(len(group), device=group.device) - (counts.cumsum(0) - counts)[group]
    out = values.new_full((n_queries, int(counts.max())), fill)
    out[group, slot] = values
    return out


def bce_losses(scores: Tensor, batch: RerankBatch) -> Tensor:
    """Each query's summed binary cross-entropy of its pairs' logits against their labels."""
    pairs = nn.functional.binary_cross_entropy_with_logits(scores, batch.label, reduction="none")
    return scores.new_zeros(batch.n_examples).index_add(0, batch.group, pairs)


def mnrl_losses(scores: Tensor, batch: RerankBatch) -> Tensor:
    """Each query's cross-entropy of its positive (its first row) among its rows, on MNRL_SCALE x sigmoid(logit)."""
    logits = by_query(torch.sigmoid(scores) * MNRL_SCALE, batch.group, batch.n_examples, float("-inf"))
    return nn.functional.cross_entropy(logits, logits.new_zeros(batch.n_examples, dtype=torch.long), reduction="none")


def _ndcg_loss2(gain: Tensor, discount: Tensor) -> Tensor:
    positions = torch.arange(1, gain.shape[1] + 1, device=gain.device)
    apart = (positions[:, None] - positions[None, :]).abs()
    deltas = (discount[0, apart - 1].abs().pow(-1.0) - discount[0, apart].abs().pow(-1.0)).abs()
    deltas.diagonal().zero_()
    return deltas[None] * (gain[:, :, None] - gain[:, None, :]).abs()


def _lambdarank(gain: Tensor, discount: Tensor) -> Tensor:
    return ((discount[:, :, None].pow(-1.0) - discount[:, None, :].pow(-1.0)).abs()
            * (gain[:, :, None] - gain[:, None, :]).abs())


# LambdaLoss's weighting schemes (sentence-transformers' NDCGLoss2PPScheme, NDCGLoss2Scheme, NDCGLoss1Scheme,
# LambdaRankScheme, NoWeightingScheme): the weight of each pair of ranks from the gains and discounts
WEIGHTING_SCHEMES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "ndcg_loss2pp": lambda gain, discount: LAMBDA_MU * _ndcg_loss2(gain, discount) + _lambdarank(gain, discount),
    "ndcg_loss2": _ndcg_loss2,
    "ndcg_loss1": lambda gain, discount: (gain / discount)[:, :, None],
    "lambdarank": _lambdarank,
    "none": lambda gain, discount: gain.new_ones(()),
}


def lambda_pairs(labels: Tensor, scheme: str) -> Tensor:
    """The rank pairs LambdaLoss counts [queries, n, n] (labels [queries, n], -inf where a query has no document):
    those of a higher label over a lower one (ndcg_loss1: every pair of two documents)."""
    apart = labels[:, :, None] - labels[:, None, :]
    return torch.isfinite(apart) if scheme == "ndcg_loss1" else torch.isfinite(apart) & (apart > 0)


def lambda_losses(scores: Tensor, batch: RerankBatch, scheme: str) -> Tensor:
    """Each query's LambdaLoss sum (binary log) over its counted rank pairs, as sentence-transformers computes it on
    the batch's [queries, documents] matrix."""
    logits = by_query(scores, batch.group, batch.n_examples, PADDED_LOGIT)
    labels = by_query(batch.label, batch.group, batch.n_examples, float("-inf"))
    sorted_logits, order = logits.sort(descending=True, dim=-1)
    ideal = labels.sort(descending=True, dim=-1).values.clamp(min=0.0)
    true_by_pred = labels.gather(1, order)
    counted = lambda_pairs(true_by_pred, scheme)
    discount = torch.log2(1.0 + torch.arange(1, logits.shape[1] + 1, device=logits.device).float())[None, :]
    max_dcg = ((2.0 ** ideal - 1) / discount).sum(-1).clamp(min=LAMBDA_EPS)
    gain = (2.0 ** true_by_pred.clamp(min=0.0) - 1) / max_dcg[:, None]
    apart = (sorted_logits[:, :, None] - sorted_logits[:, None, :]).clamp(min=-1e8, max=1e8).nan_to_num(nan=0.0)
    losses = WEIGHTING_SCHEMES[scheme](gain, discount) * nn.functional.logsigmoid(LAMBDA_SIGMA * apart) / math.log(2)
    return -torch.where(counted, losses, 0.0).sum((1, 2))


@dataclass(frozen=True)
class Reranker:
    """A reranker's training loss (--rerank_loss bce, mnrl or lambda) with its options: the in-batch negatives MNRL
    scores (`num_negatives`, added to each query's rows when its batches are made) and LambdaLoss's weighting
    scheme."""

    loss: str = "bce"
    num_negatives: int = 0
    weighting_scheme: str = "ndcg_loss2pp"

    def __call__(self, model: nn.Module, batch: RerankBatch) -> Tensor:
        """Per-query losses [halves x queries] of the batch's pairs scored by the model."""
        return self.from_scores(pair_logits(model, batch.input_ids, batch.attention_mask, batch.token_type_ids), batch)

    def from_scores(self, scores: Tensor, batch: RerankBatch) -> Tensor:
        """Per-query losses [halves x queries] of the pairs' logits; each half of MeZO's dual batch on its own."""
        def losses(half: Tensor) -> Tensor:
            if self.loss == "bce":
                return bce_losses(half, batch)
            if self.loss == "mnrl":
                return mnrl_losses(half, batch)
            return lambda_losses(half, batch, self.weighting_scheme)

        return torch.cat([losses(half) * batch.weight.to(half.device) for half in scores.chunk(batch.halves)])

    def weights(self, batch: RerankBatch) -> Tensor:
        """Each query's weight [queries], so that the mean of the weighted losses is sentence-transformers' loss of
        the batch: queries / pairs for bce (the mean over pairs), queries / counted rank pairs for lambda (its mean
        over them), 1 for mnrl (the mean over queries)."""
        queries = batch.n_examples
        if self.loss == "mnrl":
            return torch.ones(queries)
        if self.loss == "bce":
            return torch.full((queries,), queries / batch.label.shape[0])
        labels = by_query(batch.label, batch.group, queries, float("-inf"))
        return torch.full((queries,), queries / max(int(lambda_pairs(labels, self.weighting_scheme).sum()), 1))
