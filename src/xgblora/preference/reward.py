"""A reward model's loss as TRL's RewardTrainer computes it, its logged metrics, and the held-out evaluation.

A sequence classifier with one output scores each whole sequence, r = model(prompt + completion).logits[:, 0] (the
model's own head on its last non-padding token, as transformers' *ForSequenceClassification read it; a causal
LM's classifier runs each pair's shared prompt once, both sequences reading its KV cache, for the same values); a
pair's loss is the Bradley-Terry one, -log sigmoid(r_chosen - r_rejected - margin), plus, with
center_rewards_coefficient c, c (r_chosen + r_rejected)^2 (Eisenstein et al. 2023, Eq. 2), which holds the rewards
near 0. The mean over pairs is TRL's loss. Its metrics are TRL's: accuracy (chosen scored above rejected), margin (r_chosen - r_rejected, the
data's margin not taken off), and the mean, min and max reward of each forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xgblora.data.batches import RewardBatch
from xgblora.data.preference import RewardSeq, collate_rewards
from xgblora.models.scoring import classifier_parts, eval_mode, shared_prefix_last_states


def sequence_rewards(model: nn.Module, batch: RewardBatch) -> Tensor:
    """The reward of every row of the batch [rows] (chosen rows, then rejected; each half of a dual batch so): each
    pair's shared prompt run once where the batch has them and the model allows (`shared_rewards`), else the whole
    sequences through the model."""
    parts = classifier_parts(model) if batch.prompt_ids is not None else None
    if parts is not None:
        return shared_rewards(*parts, batch)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits[:, 0].float()


def shared_rewards(backbone: nn.Module, head: nn.Module, pad_id: int, batch: RewardBatch) -> Tensor:
    """The rewards of `sequence_rewards`, each pair's prompt run once and its KV cache read by both completions
    (`shared_prefix_last_states`), the head on each sequence's last token that is not padding, as the classifier's
    own forward reads it: the same values and gradients, P + C + R tokens a pair instead of 2P + C + R."""
    rows, per_half = batch.completion_ids.shape[0], batch.n_examples
    index = torch.arange(rows, device=batch.completion_ids.device)
    row_prompt = index // (2 * per_half) * per_half + index % per_half  # half h: its chosen rows, then its rejected
    states = shared_prefix_last_states(backbone, batch.prompt_ids, batch.prompt_mask, row_prompt,
                                       batch.completion_ids, batch.completion_mask, pad_id)
    return head(states)[:, 0].float()


def shares_prompts(model: nn.Module, pad_id: int) -> bool:
    """Whether `sequence_rewards` can run the model's pairs on their shared prompts: a causal LM's classifier
    (`classifier_parts`) that pads with the collator's pad id."""
    parts = classifier_parts(model)
    return parts is not None and parts[2] == pad_id


def pair_losses(chosen: Tensor, rejected: Tensor, margin: Tensor | None, center: float | None) -> Tensor:
    """Each pair's loss [pairs]: -log sigmoid(r_c - r_r - margin), plus center (r_c + r_r)^2 with a coefficient."""
    gap = chosen - rejected if margin is None else chosen - rejected - margin.to(chosen.dtype)
    losses = -F.logsigmoid(gap)
    return losses if center is None else losses + center * (chosen + rejected) ** 2


class RewardStatistics:
    """TRL's logged reward-model metrics, summed on the device since the last drain (one host sync per drain):
    accuracy and margin per pair, mean_reward per sequence, min_reward and max_reward per forward (TRL averages
    each forward's extremes)."""

    def __init__(self) -> None:
        self.sums: Tensor | None = None

    def add(self, chosen: Tensor, rejected: Tensor) -> None:
        """Add one forward's pairs."""
        chosen, rejected = chosen.detach(), rejected.detach()
        both = torch.cat([chosen, rejected])
        values = torch.stack([(chosen > rejected).float().sum(), (chosen - rejected).sum(), both.sum(), both.min(),
                              both.max(), torch.tensor(float(len(chosen)), device=both.device),
                              torch.ones((), device=both.device)]).float()
        self.sums = values if self.sums is None else self.sums + values

    def drain(self) -> dict[str, float]:
        """Means since the last drain; starts over. Empty when nothing was added."""
        if self.sums is None:
            return {}
        correct, margin, total, low, high, pairs, forwards = self.sums.tolist()
        self.sums = None
        return {"accuracy": correct / pairs, "margin": margin / pairs, "mean_reward": total / (2 * pairs),
                "min_reward": low / forwards, "max_reward": high / forwards}


class RewardLoss:
    """loss(model, batch) -> each pair's loss [halves x pairs] (times the batch's loss_scale), for the steppers
    (AdamW and MeZO); `statistics` holds TRL's metrics of what it scored."""

    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center = center_rewards_coefficient
        self.statistics = RewardStatistics()

    def __call__(self, model: nn.Module, batch: RewardBatch) -> Tensor:
        rewards = sequence_rewards(model, batch)
        for half in rewards.chunk(batch.halves):
            self.statistics.add(*half.chunk(2))
        return self.losses(rewards, batch)

    def losses(self, rewards: Tensor, batch: RewardBatch) -> Tensor:
        """Each pair's loss [halves x pairs] from the rewards of the batch's rows, times the batch's loss_scale."""
        margins = [None] * batch.halves if batch.margin is None else batch.margin.chunk(batch.halves)
        return torch.cat([pair_losses(*half.chunk(2), margin, self.center)
                          for half, margin in zip(rewards.chunk(batch.halves), margins, strict=True)]) * batch.loss_scale


@torch.no_grad()
def evaluate_rewards(model: nn.Module, seqs: Sequence[RewardSeq], pad_id: int, batch_size: int,
                     device: torch.device, center: float | None = None, shared: bool = False) -> dict[str, float]:
    """Held-out pairs in eval mode: the mean loss and TRL's metrics (accuracy is the preference accuracy); shared:
    each pair's prompt run once (`collate_rewards`)."""
    loss = RewardLoss(center)
    total = 0.0
    with eval_mode(model):
        for start in range(0, len(seqs), batch_size):
            batch = collate_rewards(seqs[start:start + batch_size], pad_id, shared).to(device)
            total += float(loss(model, batch).sum())
    return {"loss": total / len(seqs), **loss.statistics.drain()}
