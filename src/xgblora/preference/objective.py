"""The preference losses as TRL computes them, on each pair's summed completion log-probabilities.

With pi / ref the policy's and the reference's summed log-probabilities of a completion, n its tokens, and the log
ratios c = pi(chosen) - ref(chosen), r = pi(rejected) - ref(rejected), d = c - r (TRL's DPOTrainer, reverse KL):

- sigmoid (DPO): -log sigmoid(beta d); hinge: relu(1 - beta d);
- ipo: (c / n_chosen - r / n_rejected - 1 / (2 beta))^2 (TRL's per-token normalisation);
- robust: (-(1 - ls) log sigmoid(beta d) + ls log sigmoid(-beta d)) / (1 - 2 ls), ls = label_smoothing;
- simpo (TRL's CPOTrainer, loss_type simpo, no reference): with average log-probabilities a = pi / n,
  u = a(chosen) - a(rejected) - gamma / beta: -(1 - ls) log sigmoid(beta u) - ls log sigmoid(-beta u);
- orpo (TRL's ORPOTrainer, no reference): the chosen completions' NLL minus beta log sigmoid(log odds), the log
  odds ratio of the average log-probabilities, log(p / (1 - p)) of chosen minus that of rejected;
- sft: the chosen completions' NLL, the mean over the batch's chosen tokens (TRL's loss type sft; with sigmoid,
  RPO's rpo_alpha is its weight).

Several loss types add up with their loss_weights (TRL's list form). The rewards TRL logs are beta times the log
ratios (reference_free: the reference's log-probabilities are 0), or beta times the average log-probabilities
for simpo and orpo, alone or with sft (CPO's cpo_alpha), as CPO and ORPO log them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from xgblora.config import DPO_POLICY_ONLY as POLICY_ONLY  # the loss types that read no reference


@dataclass(frozen=True)
class Objective:
    """Which losses, with TRL's options."""

    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference_free: bool = False

    @property
    def needs_reference(self) -> bool:
        """Whether a reference's log-probabilities enter the loss."""
        return not self.reference_free and any(t not in POLICY_ONLY for t in self.loss_type)

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0,) * len(self.loss_type)

    @property
    def average_rewards(self) -> bool:
        """Rewards from average log-probabilities (SimPO's and ORPO's), not from log ratios: also with the chosen NLL
        beside them (sft, or rpo_alpha), which is CPO's cpo_alpha term and leaves CPO's logged rewards as they are."""
        return any(t in ("simpo", "orpo") for t in self.loss_type) and set(self.loss_type) <= {"simpo", "orpo", "sft"}


@dataclass
class PairScores:
    """Per pair [n]: the summed completion log-probabilities of chosen and rejected, their token counts, and the
    reference's sums (None: no reference)."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None

    def log_ratios(self, reference_free: bool) -> tuple[Tensor, Tensor]:
        if reference_free or self.ref_chosen is None:
            return self.chosen, self.rejected
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected

    def averages(self) -> tuple[Tensor, Tensor]:
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


def pair_losses(obj: Objective, s: PairScores) -> Tensor:
    """Each pair's loss [n]: the weighted sum of its loss types (their mean over pairs is TRL's loss)."""
    return sum(w * LOSSES[t](obj, s) for t, w in zip(obj.loss_type, obj.weights, strict=True))


def rewards(obj: Objective, s: PairScores) -> tuple[Tensor, Tensor]:
    """The chosen and rejected rewards TRL logs [n] (no gradient)."""
    c, r = s.averages() if obj.average_rewards else s.log_ratios(obj.reference_free)
    return obj.beta * c.detach(), obj.beta * r.detach()


def _delta(obj: Objective, s: PairScores) -> Tensor:
    c, r = s.log_ratios(obj.reference_free)
    return c - r


def _sigmoid(obj: Objective, s: PairScores) -> Tensor:
    return -F.logsigmoid(obj.beta * _delta(obj, s))


def _hinge(obj: Objective, s: PairScores) -> Tensor:
    return torch.relu(1 - obj.beta * _delta(obj, s))


def _ipo(obj: Objective, s: PairScores) -> Tensor:
    c, r = s.log_ratios(obj.reference_free)
    return (c / s.chosen_tokens.clamp(min=1) - r / s.rejected_tokens.clamp(min=1) - 1 / (2 * obj.beta)) ** 2


def _robust(obj: Objective, s: PairScores) -> Tensor:
    d, ls = obj.beta * _delta(obj, s), obj.label_smoothing
    return (-(1 - ls) * F.logsigmoid(d) + ls * F.logsigmoid(-d)) / (1 - 2 * ls)


def _simpo(obj: Objective, s: PairScores) -> Tensor:
    c, r = s.averages()
    u, ls = obj.beta * (c - r - obj.simpo_gamma / obj.beta), obj.label_smoothing
    return -F.logsigmoid(u) * (1 - ls) - F.logsigmoid(-u) * ls


def _nll(obj: Objective, s: PairScores) -> Tensor:  # noqa: ARG001 -- one signature for every loss type
    """The chosen tokens' mean NLL over the batch, spread so the pairs' mean is it: -pi_i n / (chosen tokens)."""
    return -s.chosen * s.chosen.shape[0] / s.chosen_tokens.sum().clamp(min=1)


def _orpo(obj: Objective, s: PairScores) -> Tensor:
    c, r = (a.float() for a in s.averages())
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return _nll(obj, s) - obj.beta * F.logsigmoid(log_odds)


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler's switch at -log 2)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


LOSSES: dict[str, Callable[[Objective, PairScores], Tensor]] = {  # config.DPO_LOSS_TYPES
    "sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge, "robust": _robust, "simpo": _simpo, "orpo": _orpo,
    "sft": _nll}


class Statistics:
    """TRL's logged preference metrics, summed on the device since the last drain (one host sync per drain)."""

    NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")

    def __init__(self) -> None:
        self.sums: Tensor | None = None  # the pair metrics' sums, then logits sums and token counts

    def add(self, obj: Objective, s: PairScores, logit_sums: tuple[Tensor, Tensor]) -> None:
        """Add one forward's pairs; logit_sums: the summed mean logit over the chosen and rejected tokens [n]."""
        chosen, rejected = rewards(obj, s)
        values = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                              (chosen - rejected).sum(), s.chosen.detach().sum(), s.rejected.detach().sum(),
                              logit_sums[0].sum(), logit_sums[1].sum(), s.chosen_tokens.sum(), s.rejected_tokens.sum(),
                              torch.tensor(float(len(chosen)), device=chosen.device)]).float()
        self.sums = values if self.sums is None else self.sums + values

    def drain(self) -> dict[str, float]:
        """Means since the last drain (per pair; logits/* per token); starts over. Empty when nothing was added."""
        if self.sums is None:
            return {}
        *pairs, chosen_logits, rejected_logits, chosen_tokens, rejected_tokens, n = self.sums.tolist()
        self.sums = None
        means = {name: value / n for name, value in zip(self.NAMES, pairs, strict=True)}
        return {**means, "logits/chosen": chosen_logits / max(chosen_tokens, 1.0),
                "logits/rejected": rejected_logits / max(rejected_tokens, 1.0)}
