"""The forwards of preference training: each pair's prompt runs once and its KV cache serves both completions,
the LM head runs at completion positions only; the policy's loss, the reference's log-probabilities (the model
with its adapters off, or precomputed), and the reward accuracy of held-out pairs.

A pair of a P-token prompt and completions of C and R tokens costs P + C + R tokens of forward and backward, not
2P + C + R as two full rows do; gradients reach the prompt's forward through the shared cache, so values and
gradients are those of the full rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TypeVar

import torch
from torch import Tensor, nn

from xgblora.data.batches import PreferenceBatch
from xgblora.data.preference import PreferenceSeq, collate_preferences
from xgblora.models.scoring import completion_scores, eval_mode
from xgblora.preference.objective import Objective, PairScores, Statistics, pair_losses

Row = TypeVar("Row")  # a row of tokens: a pair, or KTO's row


def completion_logps(model: nn.Module, batch: PreferenceBatch, with_logits: bool = False,
                     fused: bool = True) -> tuple[Tensor, Tensor | None]:
    """Summed log-probabilities of each completion row [rows] and, when asked, the sum over its tokens of the mean
    logit (TRL's logits/*), [rows], no gradient; fused: through the fused LM head where the model allows it."""
    rows, per_half = batch.completion_ids.shape[0], batch.n_examples  # prompts of a half
    index = torch.arange(rows, device=batch.completion_ids.device)
    # half h's rows: its k blocks (chosen, rejected), each holding every prompt of the half once
    row_prompt = index // (batch.completions_per_prompt * per_half) * per_half + index % per_half
    scores = completion_scores(model, batch.prompt_ids, batch.prompt_mask, row_prompt, batch.completion_ids,
                               batch.completion_mask, statistics=with_logits, fused=fused)
    return scores.logprobs.sum(1), scores.mean_logit.sum(1) if with_logits else None


def scores(batch: PreferenceBatch, logps: Tensor, ref_logps: Tensor | None) -> list[PairScores]:
    """The pairs of each half of the batch: chosen and rejected sums, token counts, reference sums."""
    tokens = batch.completion_mask.sum(1)

    def pairs(t: Tensor | None) -> list[tuple[Tensor, Tensor] | tuple[None, None]]:
        return [(None, None)] * batch.halves if t is None else [tuple(h.chunk(2)) for h in t.chunk(batch.halves)]

    return [PairScores(c, r, ct, rt, rc, rr)
            for (c, r), (ct, rt), (rc, rr) in zip(pairs(logps), pairs(tokens), pairs(ref_logps), strict=True)]


class PreferenceLoss:
    """loss(model, batch) -> each pair's loss [halves x pairs], for the steppers (AdamW and MeZO); the reference is
    the batch's precomputed log-probabilities, else the model inside `reference()` (its adapters off)."""

    def __init__(self, objective: Objective, reference: Callable[[], AbstractContextManager] | None = None,
                 fused: bool = True):
        self.objective, self.reference, self.fused = objective, reference, fused
        self.statistics = Statistics()

    def __call__(self, model: nn.Module, batch: PreferenceBatch) -> Tensor:
        logps, logit_sums = completion_logps(model, batch, with_logits=True, fused=self.fused)
        ref = batch.ref_logps
        if ref is None and self.objective.needs_reference:
            if self.reference is None:
                raise ValueError("this objective needs the reference's log-probabilities: precompute them or give "
                                 "a reference")
            with torch.no_grad(), self.reference():  # the halves of MeZO's dual batch are copies: one suffices
                ref = completion_logps(model, first_half(batch), fused=self.fused)[0].repeat(batch.halves)
        losses = []
        for s, (lc, lr) in zip(scores(batch, logps, ref), _halves(logit_sums, batch.halves), strict=True):
            losses.append(pair_losses(self.objective, s))
            self.statistics.add(self.objective, s, (lc, lr))
        return torch.cat(losses) * batch.loss_scale


def first_half(batch: PreferenceBatch) -> PreferenceBatch:
    """The batch itself, or the first half of MeZO's dual batch (the second is its copy)."""
    if batch.halves == 1:
        return batch
    prompts, rows = batch.prompt_ids.shape[0] // 2, batch.completion_ids.shape[0] // 2
    return dataclasses.replace(batch, prompt_ids=batch.prompt_ids[:prompts], prompt_mask=batch.prompt_mask[:prompts],
                               completion_ids=batch.completion_ids[:rows], completion_mask=batch.completion_mask[:rows],
                               ref_logps=None, label=None if batch.label is None else batch.label[:prompts], halves=1)


def _halves(t: Tensor, halves: int) -> list[tuple[Tensor, Tensor]]:
    return [tuple(h.chunk(2)) for h in t.chunk(halves)]


@torch.no_grad()
def reference_logps(model: nn.Module, seqs: Sequence[Row], collate: Callable[[Sequence[Row]], PreferenceBatch],
                    batch_size: int, device: torch.device,
                    reference: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> Tensor:
    """The reference's summed completion log-probabilities of every row [rows, k] (a pair's chosen and rejected;
    KTO's completion and KL completion), computed once (TRL's precompute_ref_log_probs), in eval mode; `collate`
    makes a batch of rows."""
    out = []
    with eval_mode(model), reference():
        for start in range(0, len(seqs), batch_size):
            batch = collate(seqs[start:start + batch_size]).to(device)
            out.append(completion_logps(model, batch)[0].float().view(batch.completions_per_prompt, -1).T)
    return torch.cat(out).cpu()


@torch.no_grad()
def evaluate_pairs(model: nn.Module, seqs: Sequence[PreferenceSeq], ref: Tensor | None, objective: Objective,
                   pad_id: int, batch_size: int, device: torch.device) -> dict[str, float]:
    """Held-out pairs: the loss and TRL's metrics (rewards/accuracies is the reward accuracy), in eval mode; ref
    [pairs, 2] the reference's log-probabilities of these pairs (None: the objective needs none)."""
    statistics, total = Statistics(), 0.0
    with eval_mode(model):
        for start in range(0, len(seqs), batch_size):
            batch = collate_preferences(seqs[start:start + batch_size], pad_id,
                                        None if ref is None else ref[start:start + batch_size]).to(device)
            logps, logit_sums = completion_logps(model, batch, with_logits=True)
            (s,), ((lc, lr),) = scores(batch, logps, batch.ref_logps), _halves(logit_sums, 1)
            total += float(pair_losses(objective, s).sum())
            statistics.add(objective, s, (lc, lr))
    return {"loss": total / len(seqs), **statistics.drain()}

