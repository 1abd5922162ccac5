"""GRPO's objective (DeepSeekMath), as TRL's `GRPOTrainer` computes it: group-normalised advantages, the clipped
surrogate, the k3 KL to a reference, and the loss types' normalisations; the batch of scored completions and the
forward that scores them.

With rewards r (one per completion, G completions per prompt), the new, old (at sampling time) and reference
log-probabilities of each completion token, and its mask m:

- advantage A_i = r_i - mean(r of i's group), divided by (std + 1e-4) where std is the group's (scale_rewards
  group), the whole generation batch's (batch), or not at all (none); std is Bessel-corrected. A completion that
  every reward function left unscored (None) gets A = 0 and is left out of its group's mean and std.
- ratio rho_it = exp(logp_it - old_it) (importance_sampling_level token), or one ratio per completion,
  rho_i = exp(masked mean over t of (logp_it - old_it)) (sequence: GSPO); per-token loss
  l_it = -min(rho A_i, clip(rho, 1 - epsilon, 1 + epsilon_high) A_i) + beta kl_it, with
  kl_it = (exp(ref_it - logp_it) - (ref_it - logp_it) - 1) rho (k3; times rho: TRL's use_bias_correction_kl);
  `cispo` instead l_it = -sg(min(rho, epsilon_high)) A_i logp_it + beta kl_it (the ratio clipped, not the term).
- the loss of an optimizer step's n completions: `grpo` the mean over completions of each one's token mean;
  `bnpo` the mean over its micro-batches of each one's token mean; `dr_grpo` sum(l m) / (n *
  max_completion_length); `dapo` and `cispo` sum(l m) / (the generation batch's completion tokens, at least 1,
  / optimizer steps per generation batch), the token mean over the generation batch.

RLOO (--advantage_estimator rloo, as TRL's RLOOTrainer): each completion's total reward, clipped to
reward_clip_range, less beta sum_t (old_it - ref_it) (the KL to the reference in the reward, first-order, summed over
the completion), then A_i = r_i - the mean of the other scored rewards of its group (leave-one-out), with
normalize_advantages divided, centred on the batch mean, by the batch std + 1e-4; the loss of a completion is the
clipped surrogate of one ratio, exp(sum over its tokens of (logp_it - old_it)), and an optimizer step's loss the mean
over its completions (the `grpo` weights, each completion's token losses being that one value).

Each normalisation is a weight per completion (`row_weights`), so a step's loss is the mean over its completions
of w_i sum_t l_it m_it: the steppers' micro-batches and MeZO's dual batch, which average per-row losses, compute
it unchanged. Log-probabilities are those of the logits divided by the sampling temperature (as TRL), only the
completion positions reach the LM head, and each prompt's forward serves all its completions in a batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from xgblora.config import GRPOConfig
from xgblora.data.batches import TokenBatch
from xgblora.models.scoring import completion_scores

# what row_weights knows (GRPOConfig's --loss_type choices, pinned to it by a test)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
STD_EPS = 1e-4  # TRL's: A = (r - mean) / (std + 1e-4)


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN where fewer than two values), over dim or all."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    corrected = torch.where(count > 1, variance * count / (count - 1), torch.full_like(variance, float("nan")))
    return corrected.sqrt().squeeze(dim) if dim is not None else corrected.sqrt().reshape(())


def reward_scale(rewards: Tensor, group_size: int, scale_rewards: str = "group") -> Tensor:
    """The std [n] each completion's advantage is divided by: its group's (group; also none, where it only tells
    a group without spread), or the whole batch's (batch); 0 for groups of one, NaN where fewer than two scored."""
    if scale_rewards == "batch":
        return nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    if group_size < 2:
        return torch.zeros_like(rewards)
    return nanstd(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size)


def advantages(rewards: Tensor, group_size: int, scale_rewards: str = "group") -> Tensor:
    """Group-normalised advantages of rewards [n] (groups of group_size adjacent completions; NaN: unscored)."""
    mean = torch.nanmean(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size)
    centred = rewards - mean
    if scale_rewards != "none":
        centred = centred / (reward_scale(rewards, group_size, scale_rewards) + STD_EPS)
    return torch.nan_to_num(centred, nan=0.0)


def rloo_advantages(rewards: Tensor, group_size: int, normalize: bool = False) -> Tensor:
    """TRL's RLOOTrainer's advantages of rewards [n] (groups of group_size adjacent completions; NaN: unscored): each
    reward minus the mean of the other scored rewards of its group, with `normalize` centred on the batch's mean and
    divided by its std + 1e-4; 0 where unscored, or alone in its group to be scored."""
    grouped = rewards.view(-1, group_size)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    advantage = rewards - others.view(-1)
    if normalize:
        advantage = (advantage - torch.nanmean(advantage)) / (nanstd(advantage) + STD_EPS)
    return torch.nan_to_num(advantage, nan=0.0)


def normalized_sum(per_function: Tensor, weights: Tensor, group_size: int) -> Tensor:
    """TRL's multi_objective_aggregation normalize_then_sum (GDPO): each function's rewards [n, functions] centred
    and scaled within their group, then weighted and summed (unscored values skipped); NaN where none scored. Its
    advantages are then those of the whole batch: advantages(total, n, "batch")."""
    grouped = per_function.view(-1, group_size, per_function.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1).unsqueeze(1) if group_size > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + STD_EPS)).view_as(per_function)
    total = (normalized * weights).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_function).all(dim=1), math.nan)


def row_weights(completion_mask: Tensor, loss_type: str, max_completion_length: int, rows_per_step: int,
                generation_tokens: float, steps: int, micro_batch: int) -> Tensor:
    """Each completion's weight w_i [n], so that an optimizer step's loss is the mean over its rows_per_step
    completions of w_i sum_t l_it m_it (module docstring). The rows are in training order: bnpo's micro-batches
    are consecutive runs of micro_batch rows. dapo and cispo divide by generation_tokens (the whole generation
    batch's, at least 1, as TRL clamps it) over steps (its optimizer steps; data-parallel: times the processes,
    with rows_per_step a process's rows, so that the mean over processes is the one-process loss)."""
    n = completion_mask.shape[0]
    tokens = completion_mask.sum(1).float()
    if loss_type == "grpo":
        return 1.0 / tokens.clamp(min=1)
    if loss_type == "bnpo":
        per_micro_batch = tokens.view(-1, micro_batch).sum(1).clamp(min=1)
        return (micro_batch / per_micro_batch).repeat_interleave(micro_batch)
    if loss_type == "dr_grpo":
        return torch.full((n,), 1.0 / max_completion_length)
    if loss_type in ("dapo", "cispo"):
        return torch.full((n,), rows_per_step * steps / max(generation_tokens, 1.0))
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


@dataclass(frozen=True)
class Objective:
    """The options of the clipped surrogate (TRL's names); `estimator` rloo: TRL's RLOOTrainer's loss (one ratio per
    completion, of its whole probability; see the module docstring)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    bias_correction_kl: bool = True
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    estimator: str = "grpo"

    @classmethod
    def of(cls, cfg: GRPOConfig) -> Objective:
        """The loss of a run: GRPO's options, or under --advantage_estimator rloo RLOO's, whose completions weigh
        once each in the mean (`grpo` weights) and whose KL is in the reward, not in the loss."""
        if cfg.advantage_estimator == "rloo":
            return cls(cfg.epsilon, cfg.epsilon_high, loss_type="grpo", estimator="rloo")
        return cls(cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.use_bias_correction_kl, cfg.loss_type,
                   cfg.importance_sampling_level)

    @property
    def upper(self) -> float:
        """The upper clipping bound's epsilon (epsilon_high, else epsilon)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def token_losses(logps: Tensor, old_logps: Tensor, ref_logps: Tensor | None, advantage: Tensor,
                 objective: Objective, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """l_it of every token [n, k] and the per-token statistics (ratio clipped low/high, KL) for the logs; mask
    [n, k] marks the completion tokens (a sequence-level ratio is their mean)."""
    log_ratio = logps - old_logps
    if objective.estimator == "rloo":  # the ratio of the completion's probabilities
        log_ratio = (log_ratio * mask).sum(1, keepdim=True)
    elif objective.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    a = advantage.unsqueeze(1)
    if objective.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=objective.upper).detach() * a * logps
        stats = {"cispo_clip_ratio": ((ratio > objective.upper) & (a > 0)).float()}
    else:
        clipped = torch.clamp(ratio, 1 - objective.epsilon, 1 + objective.upper)
        loss = -torch.min(ratio * a, clipped * a)
        stats = {"clip_low": ((ratio < 1 - objective.epsilon) & (a < 0)).float(),
                 "clip_high": ((ratio > 1 + objective.upper) & (a > 0)).float()}
    if objective.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference log-probabilities")
        gap = ref_logps - logps
        kl = torch.exp(gap) - gap - 1
        if objective.bias_correction_kl:
            kl = kl * ratio
        loss = loss + objective.beta * kl
        stats["kl"] = kl.detach()
    return loss, {name: value.expand_as(logps) for name, value in stats.items()}


@dataclass(kw_only=True)
class CompletionBatch(TokenBatch):
    """Prompt + completion rows (left-padded; target_mask marks the completion tokens, stop token included) with
    what the loss needs per completion: its prompt (prompt_id, equal for rows of one prompt, and prompt_length,
    its tokens), its advantage, its weight (nll_weight: the loss type's normalisation), and the old and reference
    log-probabilities of its tokens [rows, k] (None: not computed)."""

    prompt_id: Tensor
    prompt_length: Tensor
    advantages: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None

    def rows(self, index: Tensor) -> CompletionBatch:
        """The batch of the given rows, in that order."""
        return self._map(lambda t: t[index.to(t.device)])

    def doubled(self) -> CompletionBatch:
        """MeZO's dual batch; the copy's prompts get ids of their own, so its half never shares a prompt's forward
        with the first (the halves run under opposite perturbations)."""
        offset = int(self.prompt_id.max()) + 1
        return dataclasses.replace(super().doubled(), prompt_id=torch.cat([self.prompt_id, self.prompt_id + offset]))

    def completion_lengths(self) -> Tensor:
        """Tokens of each row's completion (the stop token included)."""
        return self.attention_mask.sum(1) - self.prompt_length


def completion_logprobs(model: nn.Module, batch: CompletionBatch, temperature: float, with_entropy: bool = False,
                        fused: bool = True) -> tuple[Tensor, Tensor | None]:
    """log p(token) of the completion tokens at temperature [rows, k] (the last k columns, as target_mask; zero off
    the mask), and, when asked, the entropy of each of those positions' distributions (no gradient); fused: through
    the fused LM head where the model allows it.

    Each distinct prompt of the batch runs through the model once and its KV cache serves all its completions, so
    G completions of a P-token prompt cost P + G C tokens of forward and backward, not G (P + C). Gradients reach
    the prompt's forward through the shared cache: the values and gradients are those of the full rows."""
    lengths = batch.completion_lengths()
    prompt_ids, prompt_mask, row_prompt = _prompts(batch, lengths)
    longest = int(lengths.max())
    steps = torch.arange(longest, device=lengths.device)
    columns = (batch.input_ids.shape[1] - lengths)[:, None] + steps  # right-aligned completions, read left-aligned
    completion = batch.input_ids.gather(1, columns.clamp(max=batch.input_ids.shape[1] - 1))
    scores = completion_scores(model, prompt_ids, prompt_mask, row_prompt, completion,
                               (steps < lengths[:, None]).long(), temperature, statistics=with_entropy, fused=fused)
    k = batch.target_mask.shape[1]
    window = (torch.arange(k, device=lengths.device) - (k - lengths)[:, None]).clamp(0, longest - 1)
    entropy = scores.entropy.gather(1, window) if with_entropy else None
    return scores.logprobs.gather(1, window) * batch.target_mask, entropy


def _prompts(batch: CompletionBatch, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The batch's distinct prompts, left-padded (lengths: each row's completion tokens), their attention mask
    [prompts, width], and the prompt of each row."""
    ids, row_prompt = torch.unique(batch.prompt_id, return_inverse=True)
    owner = torch.empty(len(ids), dtype=torch.long, device=row_prompt.device).scatter_(
        0, row_prompt, torch.arange(len(row_prompt), device=row_prompt.device))  # a row of each prompt
    length = batch.prompt_length[owner]
    end = batch.input_ids.shape[1] - lengths[owner]
    width = int(length.max())
    columns = end[:, None] - width + torch.arange(width, device=end.device)
    mask = (columns >= (end - length)[:, None]).long()
    return batch.input_ids[owner].gather(1, columns.clamp(min=0)), mask, row_prompt


class Statistics:
    """Token-weighted sums of what the loss saw since the last drain: clipped fractions, KL, entropy."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, stats: dict[str, Tensor], mask: Tensor) -> None:
        """Add one forward's per-token statistics over the mask's tokens (a host sync)."""
        m = mask.float()
        values = torch.stack([(v * m).sum() for v in stats.values()] + [m.sum()]).tolist()
        for name, value in zip(stats, values, strict=False):
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.tokens += values[-1]

    def drain(self) -> dict[str, float]:
        """Means per token since the last drain (clip_ratio is the region's: low or high); starts over."""
        means = {name: value / max(self.tokens, 1.0) for name, value in self.sums.items()}
        if "clip_low" in means:
            means["clip_ratio"] = means["clip_low"] + means["clip_high"]
        self.sums, self.tokens = {}, 0.0
        return means


class GRPOLoss:
    """loss_fn(batch) -> [rows]: each completion's w_i sum_t l_it m_it, for the steppers (AdamW and MeZO)."""

    def __init__(self, model: nn.Module, objective: Objective, temperature: float,
                 autocast: torch.dtype | None = None, fused: bool = True):
        self.model, self.objective, self.temperature, self.autocast = model, objective, temperature, autocast
        self.fused = fused
        self.statistics = Statistics()

    def __call__(self, batch: CompletionBatch) -> Tensor:
        device = batch.input_ids.device
        with torch.autocast(device.type, dtype=self.autocast, enabled=self.autocast is not None):
            logps, entropy = completion_logprobs(self.model, batch, self.temperature, with_entropy=True,
                                                 fused=self.fused)
        old = logps.detach() if batch.old_logps is None else batch.old_logps
        mask = batch.target_mask
        losses, stats = token_losses(logps, old, batch.ref_logps, batch.advantages, self.objective, mask)
        self.statistics.add({**stats, "entropy": entropy}, mask)
        return (losses * mask).sum(1) * batch.nll_weight * batch.loss_scale

    def metrics(self) -> dict[str, float]:
        """This process's clip ratios, KL and entropy per token since the last call."""
        return self.statistics.drain()

