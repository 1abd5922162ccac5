"""The preference losses equal TRL's own code on fixed log-probabilities, values and gradients: DPOTrainer's
_compute_loss (sigmoid, hinge, ipo, robust, sft and their weighted sums) run on a minimal instance whose model returns
the fixed per-token log-probabilities, CPOTrainer.cpo_loss (simpo) and ORPOTrainer.odds_ratio_loss (orpo)."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from xgblora.config import DPO_LOSS_TYPES, DPO_POLICY_ONLY
from xgblora.preference.objective import LOSSES, Objective, PairScores, Statistics, pair_losses, rewards

trl = pytest.importorskip("trl")
from trl import DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

PAIRS, WIDTH = 4, 7


def fixed_inputs(seed: int = 0):
    """Token log-probabilities [2 pairs, width - 1] (a leaf), the completion mask [2 pairs, width] in TRL's layout
    (chosen rows, then rejected; a prompt of 2 to 3 tokens, completions of different lengths), reference sums."""
    g = torch.Generator().manual_seed(seed)
    token_lp = (-torch.rand(2 * PAIRS, WIDTH - 1, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    mask = torch.zeros(2 * PAIRS, WIDTH, dtype=torch.long)
    for row in range(2 * PAIRS):
        start, stop = 2 + row % 2, WIDTH - (row % 3)
        mask[row, start:stop] = 1
    ref = -torch.rand(2 * PAIRS, generator=g, dtype=torch.float64) * 6
    return token_lp, mask, ref


def trl_dpo(loss_type, weights=None, beta=0.1, label_smoothing=0.0, seed=0):
    """TRL's DPO loss and metrics on the fixed inputs, and the gradient wrt the token log-probabilities."""
    token_lp, mask, ref = fixed_inputs(seed)
    shift = mask[:, 1:]
    outputs = SimpleNamespace(log_probs=token_lp * shift, entropy=torch.zeros_like(token_lp),
                              mean_logits=torch.zeros_like(token_lp), is_top1=torch.zeros_like(shift, dtype=torch.bool))
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
                              ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                              loss_types=loss_type, loss_weights=weights or [1.0] * len(loss_type), beta=beta,
                              label_smoothing=label_smoothing, use_weighting=False,
                              _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref[:PAIRS], "ref_rejected_logps": ref[PAIRS:]}
    loss = DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, return_outputs=False)
    grad, = torch.autograd.grad(loss, token_lp)
    return loss.detach(), grad, {k: v[0] for k, v in trainer._metrics["train"].items()}


def ours(objective: Objective, seed=0, with_ref=True):
    token_lp, mask, ref = fixed_inputs(seed)
    sums = (token_lp * mask[:, 1:]).sum(1)
    tokens = mask.sum(1)
    s = PairScores(sums[:PAIRS], sums[PAIRS:], tokens[:PAIRS], tokens[PAIRS:],
                   *((ref[:PAIRS], ref[PAIRS:]) if with_ref else (None, None)))
    loss = pair_losses(objective, s).mean()
    grad, = torch.autograd.grad(loss, token_lp)
    return loss.detach(), grad, s


def test_the_loss_types_dpo_accepts_are_the_ones_with_a_loss():
    """config.DPO_LOSS_TYPES (torch-free: --loss_type is checked before the heavy imports) names exactly LOSSES,
    and the policy-only types are among them."""
    assert tuple(LOSSES) == DPO_LOSS_TYPES and set(DPO_POLICY_ONLY) < set(LOSSES)


@pytest.mark.parametrize(("loss_type", "weights", "label_smoothing"), [
    (["sigmoid"], None, 0.0), (["hinge"], None, 0.0), (["ipo"], None, 0.0), (["robust"], None, 0.2),
    (["sft"], None, 0.0), (["sigmoid", "sft"], [1.0, 0.3], 0.0), (["ipo", "hinge"], [0.5, 2.0], 0.0)])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_types_equal_trl(loss_type, weights, label_smoothing, beta):
    want, want_grad, metrics = trl_dpo(loss_type, weights, beta, label_smoothing)
    objective = Objective(tuple(loss_type), tuple(weights) if weights else None, beta, label_smoothing)
    got, grad, s = ours(objective)
    assert abs(float(got) - float(want)) < 1e-6
    assert torch.allclose(grad, want_grad, atol=1e-6)
    chosen, rejected = rewards(objective, s)
    assert abs(float(chosen.mean()) - metrics["rewards/chosen"]) < 1e-6
    assert abs(float(rejected.mean()) - metrics["rewards/rejected"]) < 1e-6
    stats = Statistics()
    stats.add(objective, s, (torch.zeros(PAIRS), torch.zeros(PAIRS)))
    logged = stats.drain()
    for name in ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert abs(logged[name] - metrics[name]) < 1e-6, name


def test_reference_free_is_a_zero_reference():
    objective = Objective(("sigmoid",), beta=0.2, reference_free=True)
    got, grad, _ = ours(objective)
    token_lp, mask, _ = fixed_inputs()
    sums = (token_lp * mask[:, 1:]).sum(1)
    want = -torch.nn.functional.logsigmoid(0.2 * (sums[:PAIRS] - sums[PAIRS:])).mean()
    assert abs(float(got) - float(want.detach())) < 1e-12
    assert not objective.needs_reference


def _trl_stub(**options):
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), **options)


@pytest.mark.parametrize(("beta", "gamma", "label_smoothing"), [(2.0, 0.5, 0.0), (0.5, 1.2, 0.1)])
def test_simpo_equals_trl_cpo(beta, gamma, label_smoothing):
    objective = Objective(("simpo",), beta=beta, simpo_gamma=gamma, label_smoothing=label_smoothing)
    got, grad, s = ours(objective, with_ref=False)
    token_lp, mask, _ = fixed_inputs()
    sums = (token_lp * mask[:, 1:]).sum(1)
    avg = sums / mask.sum(1)
    stub = _trl_stub(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=label_smoothing)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stub, avg[:PAIRS], avg[PAIRS:])
    want_grad, = torch.autograd.grad(losses.mean(), token_lp)
    assert abs(float(got) - float(losses.mean())) < 1e-6
    assert torch.allclose(grad, want_grad, atol=1e-6)
    mine = rewards(objective, s)
    assert torch.allclose(mine[0], chosen_rewards) and torch.allclose(mine[1], rejected_rewards)


@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_simpo_with_the_chosen_nll_is_trl_cpo_with_cpo_alpha(alpha):
    """--loss_type simpo sft (or --rpo_alpha): CPO's simpo loss plus cpo_alpha times the chosen NLL, and CPO's logged
    rewards, beta times the average log-probabilities (the NLL term does not change them)."""
    beta, gamma = 2.0, 0.5
    objective = Objective(("simpo", "sft"), (1.0, alpha), beta=beta, simpo_gamma=gamma)
    got, grad, s = ours(objective, with_ref=False)
    token_lp, mask, _ = fixed_inputs()
    avg = (token_lp * mask[:, 1:]).sum(1) / mask.sum(1)
    stub = _trl_stub(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stub, avg[:PAIRS], avg[PAIRS:])
    nll, nll_grad, _ = trl_dpo(["sft"])
    assert abs(float(got) - float(losses.mean() + alpha * nll)) < 1e-6
    assert torch.allclose(grad, torch.autograd.grad(losses.mean(), token_lp)[0] + alpha * nll_grad, atol=1e-6)
    stats = Statistics()
    stats.add(objective, s, (torch.zeros(PAIRS), torch.zeros(PAIRS)))
    logged = stats.drain()
    want = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).double().mean()}
    for name, value in want.items():
        assert abs(logged[name] - float(value)) < 1e-6, name


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_equals_trl_odds_ratio_plus_nll(beta):
    """ORPO: TRL's odds-ratio term on average log-probabilities, plus the chosen NLL (TRL's sft term of DPO)."""
    objective = Objective(("orpo",), beta=beta)
    got, grad, _ = ours(objective, with_ref=False)
    token_lp, mask, _ = fixed_inputs()
    avg = (token_lp * mask[:, 1:]).sum(1) / mask.sum(1)
    losses, *_ = ORPOTrainer.odds_ratio_loss(_trl_stub(beta=beta), avg[:PAIRS], avg[PAIRS:])
    nll, nll_grad, _ = trl_dpo(["sft"])
    want = nll - losses.mean()
    want_grad = nll_grad + torch.autograd.grad(-losses.mean(), token_lp)[0]
    assert abs(float(got) - float(want)) < 1e-6
    assert torch.allclose(grad, want_grad, atol=1e-6)
