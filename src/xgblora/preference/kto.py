"""KTO's loss as TRL's KTOTrainer computes it, on each row's summed completion log-probabilities, and its forwards.

With r = pi(completion) - ref(completion) a row's log ratio and z the KL estimate (loss_type kto: the batch's mean
of pi - ref over its mismatched pairs, each prompt with another row's completion, without gradient, averaged over
the processes and clamped at 0; TRL's `kl`):

- kto: a desirable row's loss is desirable_weight (1 - sigmoid(beta (r - z))), an undesirable row's
  undesirable_weight (1 - sigmoid(beta (z - r)));
- apo_zero_unpaired (no KL term): desirable_weight (1 - sigmoid(beta r)) and undesirable_weight sigmoid(beta r).

The batch's loss is the mean over its rows. The rewards TRL logs are beta r, per label. The forwards are the
shared-prompt ones of preference/scoring.py: a row's prompt runs once for its completion and its KL completion (the
latter's log-probabilities detached: TRL scores them without gradient), or, where the completions are long beside
the prompts, once more without gradient for the KL completion, whichever costs less.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xgblora.data.batches import PreferenceBatch
from xgblora.data.unpaired import UnpairedSeq, collate_unpaired
from xgblora.distributed import Distributed
from xgblora.models.scoring import eval_mode
from xgblora.preference.scoring import completion_logps, first_half


@dataclass(frozen=True)
class KTOObjective:
    """Which loss, with TRL's options."""

    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def estimates_kl(self) -> bool:
        """Whether the loss reads the KL estimate (so each row carries a mismatched completion)."""
        return self.loss_type == "kto"


def row_losses(obj: KTOObjective, log_ratios: Tensor, label: Tensor, kl: Tensor) -> Tensor:
    """Each row's loss [n] (see the module docstring); label [n] bool, kl a 0-d tensor without gradient."""
    if obj.loss_type == "kto":
        desirable = 1 - F.sigmoid(obj.beta * (log_ratios - kl))
        undesirable = 1 - F.sigmoid(obj.beta * (kl - log_ratios))
    else:
        desirable, undesirable = 1 - F.sigmoid(obj.beta * log_ratios), F.sigmoid(obj.beta * log_ratios)
    return torch.where(label, obj.desirable_weight * desirable, obj.undesirable_weight * undesirable)


def kl_estimate(kl_logps: Tensor | None, ref_kl_logps: Tensor | None) -> Tensor:
    """This process's KL estimate, TRL's: the mean log ratio over the mismatched pairs, detached (0 without them)."""
    if kl_logps is None:
        return torch.zeros((), dtype=torch.float32)
    return (kl_logps - ref_kl_logps).mean().detach().float()


def totals(obj: KTOObjective, kl: Tensor, logps: Tensor, log_ratios: Tensor, label: Tensor, logit_sums: Tensor,
           tokens: Tensor) -> Tensor:
    """One forward's sums over its rows [11], what the statistics and the KL term read (summed over the processes):
    the KL estimate, then for the desirable rows and for the undesirable ones their count, the sums of their
    rewards, log-probabilities and mean logits, and their tokens."""
    rewards = obj.beta * log_ratios.detach()
    parts = [kl.to(logps.device)]
    for rows in (label, ~label):
        rows = rows.float()
        parts += [rows.sum(), (rewards * rows).sum(), (logps.detach() * rows).sum(), (logit_sums * rows).sum(),
                  (tokens * rows).sum()]
    return torch.stack([p.float() for p in parts])


class KTOStatistics:
    """TRL's logged KTO metrics: each forward's values from its `totals` (a label's means where the forward had rows
    of it), averaged over the forwards since the last drain, as TRL averages each batch's; summed on the device."""

    NAMES = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
             "logits/chosen", "logits/rejected")

    def __init__(self) -> None:
        self.sums: Tensor | None = None  # each metric's sum over forwards, then the forwards that had it

    def add(self, t: Tensor) -> None:
        """Add one forward's `totals` (kl already averaged over processes and clamped)."""
        kl, n_c, r_c, lp_c, lg_c, tok_c, n_r, r_r, lp_r, lg_r, tok_r = t
        values = torch.stack([kl, r_c / n_c, r_r / n_r, r_c / n_c - r_r / n_r, lp_c / n_c, lp_r / n_r,
                              lg_c / tok_c, lg_r / tok_r])
        had = torch.stack([torch.ones_like(kl), n_c > 0, n_r > 0, (n_c > 0) & (n_r > 0), n_c > 0, n_r > 0,
                           tok_c > 0, tok_r > 0]).float()
        both = torch.cat([torch.where(had > 0, values, 0.0), had])
        self.sums = both if self.sums is None else self.sums + both

    def drain(self) -> dict[str, float]:
        """The means since the last drain of the metrics some forward had; starts over. Empty when nothing was
        added."""
        if self.sums is None:
            return {}
        sums = self.sums.tolist()
        self.sums = None
        n = len(self.NAMES)
        return {name: total / count for name, total, count in zip(self.NAMES, sums[:n], sums[n:], strict=True)
                if count > 0}


def block(batch: PreferenceBatch, j: int) -> PreferenceBatch:
    """The batch with the j-th completion of each prompt only (in every half)."""
    k, n = batch.completions_per_prompt, batch.n_examples
    rows = torch.arange(batch.completion_ids.shape[0], device=batch.completion_ids.device)
    rows = rows[(rows % (k * n)) // n == j]
    ref = None if batch.ref_logps is None else batch.ref_logps[rows]
    return dataclasses.replace(batch, completion_ids=batch.completion_ids[rows],
                               completion_mask=batch.completion_mask[rows], ref_logps=ref)


class KTOLoss:
    """loss(model, batch) -> each row's loss [halves x rows], for the steppers (AdamW and MeZO); the reference is the
    batch's precomputed log-probabilities, else the model inside `reference()` (its adapters off). `dist`: the
    processes the KL estimate and the logged metrics are averaged over (TRL gathers them)."""

    def __init__(self, objective: KTOObjective, reference: Callable[[], AbstractContextManager] | None = None,
                 fused: bool = True, dist: Distributed | None = None):
        self.objective, self.reference, self.fused, self.dist = objective, reference, fused, dist
        self.statistics = KTOStatistics()

    def __call__(self, model: nn.Module, batch: PreferenceBatch) -> Tensor:
        halves, n = batch.halves, batch.n_examples
        logps, kl_logps, logit_sums = self._policy(model, batch)
        ref = self._reference(model, batch).view(halves, -1, n)
        label, tokens = batch.label.view(halves, n), block(batch, 0).completion_mask.sum(1).view(halves, n)
        ratios = logps - ref[:, 0]
        per_half = torch.stack([
            totals(self.objective, kl_estimate(None if kl_logps is None else kl_logps[h], ref[h, -1]), logps[h],
                   ratios[h], label[h], logit_sums[h], tokens[h]) for h in range(halves)])
        if self.dist is not None and self.dist.world_size > 1:
            per_half = self.dist.all_sum(per_half)
            per_half[:, 0] /= self.dist.world_size
        per_half[:, 0].clamp_(min=0)
        losses = []
        for h in range(halves):
            losses.append(row_losses(self.objective, ratios[h], label[h], per_half[h, 0]))
            self.statistics.add(per_half[h])
        return torch.cat(losses) * batch.loss_scale

    def _policy(self, model: nn.Module, batch: PreferenceBatch) -> tuple[Tensor, Tensor | None, Tensor]:
        """The rows' summed log-probabilities (with gradients where they flow) and mean-logit sums, and their KL
        completions' (without gradients, as TRL's KL forward), each [halves, rows]. All on the prompts' one forward
        where no gradient flows or where the prompts are over twice as wide as the completions (the KL completions'
        backward then costs less than a second prompt pass); else the KL completions on a gradient-free pass of
        their own."""
        halves, n, k = batch.halves, batch.n_examples, batch.completions_per_prompt
        joint = not torch.is_grad_enabled() or batch.prompt_ids.shape[1] > 2 * batch.completion_ids.shape[1]
        if k == 1 or joint:
            logps, logit_sums = (t.view(halves, k, n) for t in
                                 completion_logps(model, batch, with_logits=True, fused=self.fused))
            return logps[:, 0], logps[:, 1].detach() if k == 2 else None, logit_sums[:, 0]
        logps, logit_sums = completion_logps(model, block(batch, 0), with_logits=True, fused=self.fused)
        with torch.no_grad():
            kl_logps = completion_logps(model, block(batch, 1), fused=self.fused)[0]
        return logps.view(halves, n), kl_logps.view(halves, n), logit_sums.view(halves, n)

    def _reference(self, model: nn.Module, batch: PreferenceBatch) -> Tensor:
        """The reference's sums of every completion row [halves x k x rows] (its blocks in the batch's order)."""
        if batch.ref_logps is not None:
            return batch.ref_logps
        if self.reference is None:
            raise ValueError("KTO needs the reference's log-probabilities: precompute them or give a reference")
        with torch.no_grad(), self.reference():  # the halves of MeZO's dual batch are copies: one suffices
            return completion_logps(model, first_half(batch), fused=self.fused)[0].repeat(batch.halves)


@torch.no_grad()
def evaluate_unpaired(model: nn.Module, seqs: Sequence[UnpairedSeq], ref: Tensor, objective: KTOObjective,
                      pad_id: int, batch_size: int, device: torch.device) -> dict[str, float]:
    """Held-out rows: the loss (the mean over rows) and TRL's metrics, each batch's averaged over the batches, in
    eval mode; ref [rows, k] the reference's log-probabilities of these rows."""
    loss, total = KTOLoss(objective), 0.0
    with eval_mode(model):
        for start in range(0, len(seqs), batch_size):
            batch = collate_unpaired(seqs[start:start + batch_size], pad_id, ref[start:start + batch_size])
            total += float(loss(model, batch.to(device)).sum())
    return {"loss": total / len(seqs), **loss.statistics.drain()}
