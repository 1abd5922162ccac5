"""RLOO (`xgblora grpo --advantage_estimator rloo`) against TRL's RLOOTrainer: the loss and its gradient from its own
`_compute_loss` (on a stand-in trainer), the advantages and reward logs from its `_generate_and_score_completions`
(line by line from its source), and the KL in the reward through the loop."""

import collections
import contextlib
import json
import random
import types

import pytest
import torch

from xgblora.cli import main
from xgblora.config import GRPOConfig
from xgblora.distributed import LOCAL
from xgblora.generation.grpo_objective import GRPOObjective, row_weights, token_losses
from xgblora.generation.rewards import Rewards
from xgblora.generation.rollout import Completions, Rollout
from xgblora.logs import read_metrics
from xgblora.recipes.grpo import run_grpo

trl_rloo = pytest.importorskip("trl.trainer.rloo_trainer")


def _trl_loss(logps, old, adv, mask, epsilon, epsilon_high):
    """TRL's RLOO loss of one micro-batch: `RLOOTrainer._compute_loss` on a stand-in holding only what it reads, the
    policy's per-token log-probabilities handed in; old: the summed old log-probabilities of each completion."""
    accelerator = types.SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x,
                                        autocast=contextlib.nullcontext)
    trainer = types.SimpleNamespace(accelerator=accelerator, epsilon_low=epsilon, epsilon_high=epsilon_high,
                                    aux_loss_enabled=False, model=types.SimpleNamespace(training=True),
                                    _metrics={"train": collections.defaultdict(list)})
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    n = mask.shape[0]
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_logps": old}
    return trl_rloo.RLOOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


def _fixed_batch(n=8, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, k, generator=g, dtype=torch.float64) * 3
    old = logps + 0.15 * torch.randn(n, k, generator=g, dtype=torch.float64)  # ratios on both sides of the clip
    lengths = torch.randint(1, k + 1, (n,), generator=g)
    mask = (torch.arange(k) < lengths[:, None]).double()
    return logps, old, mask, torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_loss_and_gradient_equal_trls(epsilon_high):
    """One ratio per completion, exp(sum of its token log-ratios), clipped; the mean over completions: TRL's value and
    gradient, some ratios clipped and some not."""
    logps, old, mask, adv = _fixed_batch()
    cfg = GRPOConfig(train_file="x", advantage_estimator="rloo", epsilon_high=epsilon_high)
    objective = GRPOObjective.of(cfg)
    theirs_in, ours_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    upper = 0.2 if epsilon_high is None else epsilon_high
    theirs, metrics = _trl_loss(theirs_in, (old * mask).sum(1), adv, mask, 0.2, upper)
    losses, stats = token_losses(ours_in, old, None, adv, objective, mask)
    weights = row_weights(mask, objective.policy_loss, 9, len(mask), float(mask.sum()), 1, len(mask)).double()
    ours = ((losses * mask).sum(1) * weights).mean()
    theirs.backward()
    ours.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-6, rtol=0) and ours_in.grad.abs().sum() > 0
    clipped = stats["clip_low"][:, 0] + stats["clip_high"][:, 0]  # one value per completion, on every token
    assert 0 < clipped.mean().item() < 1
    assert clipped.mean().item() == pytest.approx(metrics["clip_ratio/region_mean"][0], abs=1e-6)


def _trl_rloo(per_function, weights, group, beta, kl, clip, normalize):
    """TRL's RLOO advantages and reward logs of one generation batch (rloo_trainer.py,
    `_generate_and_score_completions`: the unscorable mask, the weighted sum, reward_clip_range, the KL penalty,
    the leave-one-out baselines, normalize_advantages, and the logged reward statistics), line by line."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if clip:
        rewards = rewards.clamp(min=clip[0], max=clip[1])
    if beta != 0.0:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, group)
    std = nanstd(grouped, dim=1)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    adv = rewards - baselines
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (nanstd(adv) + 1e-4)
    adv = torch.nan_to_num(adv, nan=0.0)
    logged = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    logged[unscorable] = torch.nan
    return adv, {"reward": torch.nanmean(logged).item(), "reward_std": nanstd(logged).item(),
                 "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}


@pytest.mark.parametrize(("beta", "clip", "normalize"), [(0.0, None, False), (0.05, None, False),
                                                         (0.05, [0.0, 1.5], True)])
def test_advantages_and_their_logs_equal_trls(beta, clip, normalize):
    """Three groups of 4, two weighted reward functions, a completion unscored by both (left out of its siblings'
    baselines, advantage 0) and one by the second; the KL penalty per completion; TRL's advantages and logs."""
    nan = float("nan")
    per_function = torch.tensor([[1.0, 0.5], [1.0, 0.5], [nan, nan], [1.0, 0.5],
                                 [0.0, 1.0], [1.0, nan], [1.0, 0.0], [0.0, 0.0],
                                 [2.0, 1.0], [0.0, 1.0], [1.0, 0.0], [3.0, 1.0]])
    kl_sums = torch.linspace(-0.5, 2.0, 12)
    tokens = torch.arange(1.0, 13.0)
    run = Rollout.__new__(Rollout)  # only rewarded() and what it reads
    run.cfg = GRPOConfig(train_file="x", advantage_estimator="rloo", beta=beta, reward_clip_range=clip,
                         normalize_advantages=normalize)
    run.rewards = Rewards(["gsm8k", "format:gsm8k"], [1.0, 0.5])
    run.group, run.dist, run.device, run.agent = 4, LOCAL, torch.device("cpu"), None
    run.score = lambda *args: per_function
    done = Completions([""] * 12, [[1]] * 12, torch.zeros(12, dtype=torch.bool))
    kl = torch.stack([kl_sums, tokens], 1) if beta else None
    _, ours, logged = run.rewarded(None, [0, 1, 2], done, None, 1, kl=kl)
    theirs, metrics = _trl_rloo(per_function, run.rewards.weights, 4, beta, kl_sums, clip, normalize)
    assert torch.allclose(ours, theirs, atol=1e-6) and ours.abs().sum() > 0 and ours[2] == 0
    for key in ("reward", "reward_std", "frac_reward_zero_std"):
        assert logged[key] == pytest.approx(metrics[key], abs=1e-6), key
    if beta:
        assert logged["kl"] == pytest.approx(float(kl_sums.sum() / tokens.sum()), abs=1e-6)


@pytest.fixture
def prompts(tmp_path, monkeypatch):
    (tmp_path / "parity_reward.py").write_text(
        "def odd_first(completion_ids, **kwargs):\n    return [float(ids[0] % 2) for ids in completion_ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"Which is larger, {a} or {b}?"} for a, b in random.Random(0).sample(
        [(a, b) for a in range(10) for b in range(10) if a != b], 8)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


@pytest.mark.parametrize("trainer", ["regular", "zo"])
def test_rloo_trains_with_the_kl_in_its_reward(prompts, trainer):
    """The first generation batch is sampled from the reference itself (a new adapter is zero), so its KL is 0; the
    policy then moves away and the KL in the reward is no longer 0. The adapter trains under AdamW and MeZO."""
    done = run_grpo(GRPOConfig(model_name="tiny-llama", train_file=str(prompts / "q.jsonl"), method="lora",
                               reward_funcs=["parity_reward:odd_first"], advantage_estimator="rloo", beta=0.05,
                               normalize_advantages=True, trainer=trainer, learning_rate=5e-2, max_new_tokens=4,
                               num_return_sequences=4, per_device_train_batch_size=8, max_steps=2, logging_steps=1,
                               save_strategy="no", device="cpu", seed=1, output_dir=str(prompts / "out")))
    logged = [r for r in read_metrics(prompts / "out" / "metrics.jsonl") if "loss" in r]
    assert done["advantage_estimator"] == "rloo" and done["policy_loss"] == "rloo" and len(logged) == 2
    assert logged[0]["kl"] == 0.0 and logged[-1]["kl"] != 0.0
    assert "clip_ratio" in logged[0]


@pytest.mark.parametrize("flags, message", [
    (["--advantage_estimator", "rloo", "--scale_rewards", "batch"], "--scale_rewards 'batch' does nothing here"),
    (["--advantage_estimator", "rloo", "--loss_type", "grpo"], "--policy_loss 'grpo' does nothing here"),
    (["--normalize_advantages"], "pass --advantage_estimator rloo"),
    (["--advantage_estimator", "rloo", "--reward_clip_range", "1", "0"], "MIN at most MAX"),
    (["--advantage_estimator", "rloo", "--trainer", "zo", "--zo_objective", "reward"], "drop one of them"),
])
def test_bad_options_are_one_line_errors(tmp_path, capsys, flags, message):
    code = main(["grpo", "--train_file", str(tmp_path / "q.jsonl"), "--output_dir", str(tmp_path / "bad"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "bad").exists()
