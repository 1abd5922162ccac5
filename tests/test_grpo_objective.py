"""GRPO's objective against TRL's own `GRPOTrainer._compute_loss` (called on a stand-in trainer), the advantages
against TRL's formula, the completion log-probabilities against autograd on full logits."""

import collections
import contextlib
import dataclasses
import types

import pytest
import torch
from conftest import completion_batch

from xgblora.adapters.lora import adapters_off, attach
from xgblora.config import GRPOConfig
from xgblora.generation.grpo_objective import (
    POLICY_LOSSES,
    GRPOLoss,
    GRPOObjective,
    advantages,
    completion_logprobs,
    row_weights,
    token_losses,
)
from xgblora.models.scoring import target_logprobs

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


@pytest.fixture
def tiny_llama():
    from xgblora.models import pretrained

    return pretrained.load("tiny-llama")


def _trl_loss(logps, old, ref, adv, mask, policy_loss, beta, epsilon, epsilon_high, *, accumulation=1,
              steps_per_generation=1, max_completion_length=None, generation_tokens=None, level="token"):
    """TRL's loss of one micro-batch: `GRPOTrainer._compute_loss` on a stand-in holding only what it reads, with
    the policy's per-token log-probabilities handed in (so its gradient with respect to them can be compared)."""
    args = types.SimpleNamespace(delta=None, use_bias_correction_kl=True, steps_per_generation=steps_per_generation)
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                        autocast=contextlib.nullcontext)
    trainer = types.SimpleNamespace(
        args=args, accelerator=accelerator, beta=beta, loss_type=policy_loss, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, importance_sampling_level=level,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, current_gradient_accumulation_steps=accumulation,
        max_completion_length=max_completion_length or mask.shape[1], model=types.SimpleNamespace(training=True),
        _metrics={"train": collections.defaultdict(list)})
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    n = mask.shape[0]
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(float(mask.sum() if generation_tokens is None else generation_tokens))}
    return trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)


def _fixed_batch(n=8, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, k, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(n, k, generator=g, dtype=torch.float64)  # ratios on both sides of the clip
    ref = logps + 0.5 * torch.randn(n, k, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, k + 1, (n,), generator=g)
    mask = (torch.arange(k) < lengths[:, None]).double()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logps, old, ref, mask, adv


def _ours(logps, old, ref, adv, mask, policy_loss, objective, max_len, *, steps=1, micro_batch=None,
          generation_tokens=None):
    """Our loss of one optimizer step whose rows are the whole batch given (one step, one micro-batch unless told)."""
    objective = dataclasses.replace(objective, policy_loss=policy_loss)
    losses, _ = token_losses(logps, old, ref, adv, objective, mask)
    tokens = float(mask.sum()) if generation_tokens is None else generation_tokens
    weights = row_weights(mask, policy_loss, max_len, len(mask), tokens, steps, micro_batch or len(mask)).double()
    return ((losses * mask).sum(1) * weights).mean()


def test_the_policy_losses_grpo_offers_are_the_ones_row_weights_knows():
    """--policy_loss's choices (config, torch-free) are POLICY_LOSSES, over which every test below runs."""
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(GRPOConfig)}
    assert choices["policy_loss"] == POLICY_LOSSES


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("beta, epsilon_high", [(0.0, None), (0.04, 0.28), (0.04, 1.2)])
def test_loss_and_gradient_equal_trls_on_one_step(policy_loss, beta, epsilon_high, level):
    """Every loss type, token-level ratios and GSPO's sequence-level ones, against TRL's `_compute_loss`; cispo at
    epsilon_high 1.2 clips some ratios and not others."""
    logps, old, ref, mask, adv = _fixed_batch()
    objective = GRPOObjective(epsilon=0.2, epsilon_high=epsilon_high, beta=beta, importance_sampling_level=level)
    theirs_in, ours_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    theirs = _trl_loss(theirs_in, old, ref, adv, mask, policy_loss, beta, 0.2, epsilon_high, max_completion_length=9,
                       level=level)
    ours = _ours(ours_in, old, ref, adv, mask, policy_loss, objective, 9)
    theirs.backward()
    ours.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-6, rtol=0)
    assert ours_in.grad.abs().sum() > 0


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_on_policy_gspo_has_grpos_gradient(policy_loss):
    """With one optimizer step per generation batch every ratio is 1: a sequence's ratio exp(mean log-ratio) has the
    derivative 1/L along each of its L tokens, and every loss type weights a sequence's tokens alike, so GSPO's
    gradient is the token-level one (in TRL's loss as in ours) at beta 0; they part off-policy, and with a KL term
    (TRL's bias correction weights each token's KL by its ratio, whose gradient differs between the two)."""
    logps, _, ref, mask, adv = _fixed_batch()
    grads = {}
    for level in ("token", "sequence"):
        for name, loss in (("trl", _trl_loss), ("ours", None)):
            policy = logps.clone().requires_grad_()
            if loss is None:
                objective = GRPOObjective(epsilon=0.2, epsilon_high=0.28, beta=0.0, importance_sampling_level=level)
                value = _ours(policy, logps, ref, adv, mask, policy_loss, objective, 9)
            else:
                value = loss(policy, logps, ref, adv, mask, policy_loss, 0.0, 0.2, 0.28, max_completion_length=9,
                             level=level)
            value.backward()
            grads[level, name] = policy.grad
    assert torch.allclose(grads["sequence", "ours"], grads["token", "ours"], atol=1e-12, rtol=0)
    assert torch.allclose(grads["sequence", "trl"], grads["token", "trl"], atol=1e-12, rtol=0)
    assert grads["token", "ours"].abs().sum() > 0
    _, old, *_ = _fixed_batch()  # off-policy: per-token ratios on both sides of 1, and the gradients part
    off = {}
    for level in ("token", "sequence"):
        policy = logps.clone().requires_grad_()  # epsilon_high 1.2: cispo's cap (a ratio) clips some ratios only
        objective = GRPOObjective(epsilon=0.2, epsilon_high=1.2, beta=0.0, importance_sampling_level=level)
        _ours(policy, old, ref, adv, mask, policy_loss, objective, 9).backward()
        off[level] = policy.grad
    assert not torch.allclose(off["sequence"], off["token"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_a_generation_batch_split_into_steps_and_micro_batches_matches_trl(policy_loss, level):
    """A generation batch of 8 completions, micro-batches of 2, 2 of them accumulated per optimizer step (TRL's
    steps_per_generation 4): each optimizer step's loss and gradient, summed over its micro-batches in TRL, equal
    ours, a mean over the step's completions with the weights of the whole generation batch (bnpo: of each
    micro-batch)."""
    logps, old, ref, mask, adv = _fixed_batch()
    objective = GRPOObjective(epsilon=0.2, epsilon_high=0.28, beta=0.04, policy_loss=policy_loss,
                          importance_sampling_level=level)
    weights = row_weights(mask, policy_loss, mask.shape[1], 4, float(mask.sum()), 2, 2).double()
    for step in range(2):
        rows = slice(4 * step, 4 * step + 4)
        theirs_in, ours_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
        theirs = sum(_trl_loss(theirs_in[r], old[r], ref[r], adv[r], mask[r], policy_loss, 0.04, 0.2, 0.28,
                               accumulation=2, steps_per_generation=4, generation_tokens=mask.sum(), level=level)
                     for r in (slice(rows.start, rows.start + 2), slice(rows.start + 2, rows.stop)))
        losses, _ = token_losses(ours_in[rows], old[rows], ref[rows], adv[rows], objective, mask[rows])
        ours = ((losses * mask[rows]).sum(1) * weights[rows]).mean()
        theirs.backward()
        ours.backward()
        assert abs(ours.item() - theirs.item()) < 1e-6
        assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("policy_loss", ["dapo", "cispo"])
def test_dapo_clamps_the_token_count_before_dividing_by_the_steps(policy_loss):
    """A generation batch with one completion token over two optimizer steps (every other completion truncated and
    masked): TRL divides by max(tokens, 1) / steps = 0.5, not by max(tokens / steps, 1)."""
    logps, old, ref, mask, adv = _fixed_batch()
    mask = torch.zeros_like(mask)
    mask[1, 0] = 1
    objective = GRPOObjective(epsilon=0.2, epsilon_high=0.28, beta=0.04, policy_loss=policy_loss)
    weights = row_weights(mask, policy_loss, mask.shape[1], 4, float(mask.sum()), 2, 2).double()
    rows = slice(0, 4)
    theirs = sum(_trl_loss(logps[r], old[r], ref[r], adv[r], mask[r], policy_loss, 0.04, 0.2, 0.28, accumulation=2,
                           steps_per_generation=4, generation_tokens=mask.sum()) for r in (slice(0, 2), slice(2, 4)))
    losses, _ = token_losses(logps[rows], old[rows], ref[rows], adv[rows], objective, mask[rows])
    ours = ((losses * mask[rows]).sum(1) * weights[rows]).mean()
    assert theirs.abs() > 0 and abs(ours.item() - theirs.item()) < 1e-9


def _trl_advantages(rewards, group, scale_rewards):
    """TRL's advantages (`_generate_and_score_completions`, sum_then_normalize), with its nanstd."""
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    if scale_rewards in ("group", "none"):
        std = trl_grpo.nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    else:
        std = trl_grpo.nanstd(rewards).expand_as(rewards)
    out = rewards - mean
    return out / (std + 1e-4) if scale_rewards != "none" else out


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trls(scale_rewards):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0])
    ours = advantages(rewards, 4, scale_rewards)
    assert torch.allclose(ours, _trl_advantages(rewards, 4, scale_rewards), atol=1e-6)
    assert torch.all(ours[4:8] == 0)  # a group with equal rewards teaches nothing


def test_an_unscored_completion_gets_no_advantage_and_leaves_its_group_out():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    out = advantages(rewards, 4, "group")
    assert out[1] == 0
    assert torch.allclose(out[[0, 2, 3]], _trl_advantages(rewards, 4, "group")[[0, 2, 3]], atol=1e-6)


# two prompts, completions of 1 to 5 tokens, the rows of a prompt not adjacent (as a shuffled generation batch)
SHARED = [(0, (5, 6, 7, 8), (9,)), (1, (11, 12), (13, 14)), (0, (5, 6, 7, 8), (15, 16, 17)),
          (0, (5, 6, 7, 8), (22, 23, 24, 25, 26)), (1, (11, 12), (18, 19, 20, 21))]


def test_completion_logprobs_score_only_the_completion_positions_at_the_temperature(tiny_llama):
    model, tokenizer = tiny_llama
    batch = completion_batch(SHARED, tokenizer.pad_token_id)
    logps, entropy = completion_logprobs(model, batch, temperature=0.7, with_entropy=True)
    for row, (_, prompt, completion) in enumerate(SHARED):
        ids = torch.tensor([prompt + completion])
        full = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double() / 0.7, dim=-1)
        n = len(completion)
        want = full[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-n:]
        assert torch.allclose(logps[row, -n:].double(), want, atol=1e-5)
        want_entropy = -(full.exp() * full).sum(-1)[-n:]
        assert torch.allclose(entropy[row, -n:].double(), want_entropy, atol=1e-4)
        assert (logps[row, :-n] == 0).all()  # off the completion: zero


@pytest.mark.parametrize("adapter", [False, True], ids=["full-float64", "lora-float32"])
def test_shared_prompt_forward_gives_the_values_and_gradients_of_full_rows(tiny_llama, adapter):
    """Each prompt runs once and its cache serves its completions: log-probabilities and the gradients of every
    trainable weight (the base's reach the prompt's forward through the cache) equal one forward of the full rows
    (`target_logprobs`, the SFT scorer), for full fine-tuning and LoRA on a float64 model. On a float32 base the
    first layer's adapter gradients, back-propagated through every layer, differ between the two summation orders
    by up to 5e-4 relative; in float64 by under 1e-6 (the adapter branch computes in float32)."""
    model, tokenizer = tiny_llama
    model.double()
    if adapter:
        torch.manual_seed(0)
        for m in attach(model, "all-linear", r=2, alpha=4).modules.values():
            m.lora_B.data.normal_(generator=torch.Generator().manual_seed(0))
    batch = completion_batch(SHARED, tokenizer.pad_token_id)
    batch = dataclasses.replace(batch, target_mask=batch.target_mask & torch.tensor([[1], [1], [0], [1], [1]]).bool())
    weight = torch.linspace(0.5, 1.5, batch.target_mask.numel(), dtype=torch.float64).view_as(batch.target_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) > 0 and (adapter or model.model.embed_tokens.weight.requires_grad)
    results = []
    for score in (lambda: completion_logprobs(model, batch, 1.0)[0], lambda: target_logprobs(model, batch)):
        logps = score()
        results.append((logps.detach(), torch.autograd.grad((logps * weight.to(logps)).sum(), params)))
    (ours, our_grads), (full, full_grads) = results
    assert torch.allclose(ours, full, rtol=0, atol=1e-6)  # log-probabilities are taken in float32 either way
    assert (ours[2] == 0).all()  # a masked (truncated) completion scores nothing
    grad_tolerance = 2e-6 if adapter else 1e-6
    for g_ours, g_full in zip(our_grads, full_grads, strict=True):
        assert (g_ours - g_full).norm() <= grad_tolerance * g_full.norm()
    assert all(g.abs().sum() > 0 for g in our_grads)


def test_the_loss_gradient_through_the_model_equals_autograd_on_the_formula(tiny_llama):
    model, tokenizer = tiny_llama
    rows = [(0, (5, 6, 7), (8, 9)), (1, (11,), (12, 13, 14))]
    batch = completion_batch(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        base, _ = completion_logprobs(model, batch, 1.0)
    g = torch.Generator().manual_seed(1)
    old = base + 0.2 * torch.randn(base.shape, generator=g) * batch.target_mask
    ref = base + 0.2 * torch.randn(base.shape, generator=g) * batch.target_mask
    adv = torch.tensor([0.7, -1.2])
    objective = GRPOObjective(beta=0.1, epsilon_high=0.28)
    weights = row_weights(batch.target_mask, "grpo", 4, 2, 5.0, 1, 2)
    cbatch = dataclasses.replace(batch, nll_weight=weights, advantages=adv, old_logps=old, ref_logps=ref)
    weight = model.model.layers[0].mlp.down_proj.weight
    GRPOLoss(model, objective, 1.0)(cbatch).mean().backward()
    ours = weight.grad.clone()
    weight.grad = None
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, -4:-1]
    logps = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, -3:, None]).squeeze(-1) * batch.target_mask
    losses, _ = token_losses(logps, old, ref, adv, objective, batch.target_mask)
    ((losses * batch.target_mask).sum(1) * weights).mean().backward()
    assert torch.allclose(ours, weight.grad, atol=1e-6)
    weight.grad = None


def test_adapters_off_gives_the_base_model(tiny_llama):
    model, _ = tiny_llama
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        report = attach(model, None, r=4, alpha=8)
        for m in report.modules.values():
            m.lora_B.normal_()
        adapted = model(input_ids=ids).logits
        with adapters_off(report.modules):
            off = model(input_ids=ids).logits
    assert not torch.allclose(adapted, before, atol=1e-4)
    assert torch.allclose(off, before, atol=1e-6)
    assert all(m.active for m in report.modules.values())
