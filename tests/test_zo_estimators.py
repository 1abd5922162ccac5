"""The estimators beyond MeZO (optim/zo_estimators.py) and the ZO optimizers, against references written here from
each paper's update rule, with z rebuilt from the documented seed recipe (optim/zo.py's docstring)."""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest
import torch
from helpers import adapted, ce_loss_fn, loss_at, no_decay, random_batch, reference_z, step_seeds
from torch import nn

from xgblora.adapters.lora import LoRALinear
from xgblora.compare import parse_method
from xgblora.config import Config
from xgblora.errors import UserError
from xgblora.models.pretrained import load
from xgblora.optim.zo import ZO_OPTIMIZERS, MeZO, ZOStepper
from xgblora.optim.zo_estimators import (
    ES,
    ESTIMATORS,
    FZOO,
    NSPSA,
    MeZOSVRG,
    SVRGStepper,
    build_estimator,
    spreads_members,
    stepper_type,
)
from xgblora.options import ZO_ESTIMATORS, ZOOptions


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    """tiny-opt in fp32 and eval mode (dropout off, as the estimators' forwards run)."""
    model, _ = load("tiny-opt")
    return model.eval()


@pytest.fixture(scope="module")
def tiny64() -> nn.Module:
    """tiny-opt in float64 and eval mode, for full fine-tuning (LoRA branches compute in fp32 whatever the base)."""
    model, _ = load("tiny-opt")
    return model.double().eval()


def lora_model(tiny: nn.Module) -> tuple[nn.Module, list[tuple[str, nn.Parameter]], dict]:
    """fp32 tiny-opt with LoRA r=2 on q/v (B random); eps 1e-2 in the tests below keeps fp32 rounding of the
    weights (between the estimator and the reference) far below 1e-6 in the step."""
    model, modules = adapted(tiny, r=2)
    return model, [(n, p) for n, p in model.named_parameters() if ".lora_" in n], modules


def trained_params(tiny: nn.Module, tiny64: nn.Module, full: bool) -> tuple[nn.Module, list[tuple[str, nn.Parameter]]]:
    """A fresh model and what the estimator trains: every float64 weight (full FT), or LoRA's factors."""
    if full:
        model = copy.deepcopy(tiny64)
        return model, list(model.named_parameters())
    model, named, _ = lora_model(tiny)
    return model, named


def state(named: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in named]


def assert_params(named: list[tuple[str, nn.Parameter]], expected: list[torch.Tensor], start: list[torch.Tensor],
                  atol: float = 1e-6):
    """Every weight equals the reference to atol, and the step moved them by far more than that."""
    for (name, p), want in zip(named, expected, strict=True):
        torch.testing.assert_close(p.detach(), want, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    moved = max(float((w - s).abs().max()) for w, s in zip(expected, start, strict=True))
    assert moved > 1e-4


def float32_atol(terms: int, theta: list[torch.Tensor]) -> float:
    """What float32 arithmetic may leave between an in-place step and its float64 reference: each of `terms`
    perturb-and-restore passes and update terms rounds a weight by at most an ulp of its size."""
    return (terms + 1) * torch.finfo(torch.float32).eps * max(1.0, max(float(t.abs().max()) for t in theta))


def losses_at(model, names, values, batches) -> float:
    """Mean per-example loss over equal-sized batches with the named weights set to values."""
    return sum(loss_at(model, names, values, b) for b in batches) / len(batches)


def shifted(theta, z, scale):
    return [t + scale * zi for t, zi in zip(theta, z, strict=True)]


# ----------------------------------------------------------------------------- one step against the papers' rules


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full-ft"])
def test_nspsa_step_is_the_mean_of_n_two_point_estimates(tiny, tiny64, full):
    model, named = trained_params(tiny, tiny64, full)
    reference = copy.deepcopy(model)
    names, theta = [n for n, _ in named], state(named)
    batch = random_batch(tiny.config.vocab_size, seed=1)
    lr, eps, wd, n = 1e-2, 1e-2, 0.1, 3
    estimator = NSPSA(named, lr=lr, eps=eps, weight_decay=wd, seed=4, queries=n)
    losses = estimator.step(ce_loss_fn(model), batch)

    update = [torch.zeros_like(t) for t in theta]
    want_losses = []
    for s in step_seeds(4, n):
        z = reference_z(theta, s)
        plus = loss_at(reference, names, shifted(theta, z, eps), batch)
        minus = loss_at(reference, names, shifted(theta, z, -eps), batch)
        want_losses += [plus, minus]
        g = (plus - minus) / (2 * eps)
        update = [u + g / n * zi for u, zi in zip(update, z, strict=True)]
    assert losses == pytest.approx(want_losses, abs=2e-6)
    decay = [0.0 if no_decay(name) else wd for name in names]
    expected = [t * (1 - lr * d) - lr * u for t, u, d in zip(theta, update, decay, strict=True)]
    assert_params(named, expected, theta)


def test_nspsa_with_one_query_is_mezo(tiny):
    model, named, _ = lora_model(tiny)
    twin = copy.deepcopy(model)
    twin_named = [(n, p) for n, p in twin.named_parameters() if ".lora_" in n]
    nspsa = NSPSA(named, lr=1e-2, eps=1e-3, weight_decay=0.05, seed=9, queries=1)
    mezo = MeZO(twin_named, lr=1e-2, eps=1e-3, weight_decay=0.05, seed=9)
    for step in range(3):
        batch = random_batch(tiny.config.vocab_size, seed=step)
        assert nspsa.step(ce_loss_fn(model), batch) == pytest.approx(mezo.step(ce_loss_fn(twin), batch), abs=1e-5)
    for (name, p), (_, q) in zip(named, twin_named, strict=True):  # fp32: MeZO fuses restore and update
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full-ft"])
def test_fzoo_step_is_the_papers_normalised_one_sided_rule(tiny, tiny64, full):
    """FZOO's zo_step/zo_update: theta -= lr sum_i (l_i - l_0) / (N std(l)) u_i, u_i Rademacher, one-sided."""
    model, named = trained_params(tiny, tiny64, full)
    reference = copy.deepcopy(model)
    names, theta = [n for n, _ in named], state(named)
    batch = random_batch(tiny.config.vocab_size, seed=2)
    lr, eps, n = 1e-3, 1e-2, 5
    estimator = FZOO(named, lr=lr, eps=eps, seed=6, queries=n)
    seen, loss_fn = [], ce_loss_fn(model)
    (reported,) = estimator.step(lambda b: seen.append(loss := loss_fn(b)) or loss, batch)

    us = [[z.sign() for z in reference_z(theta, s)] for s in step_seeds(6, n)]
    perturbed = torch.tensor([loss_at(reference, names, shifted(theta, u, eps), batch) for u in us])
    base = loss_at(reference, names, theta, batch)
    assert [float(v.mean()) for v in seen] == pytest.approx([*perturbed.tolist(), base], abs=2e-6)
    assert reported == pytest.approx(base, abs=1e-12)
    # the rule applied to the estimator's own losses: dividing their float32 rounding by their spread (~1e-3)
    # would move a reference built from the recomputed ones by ~1e-6 on its own
    own = torch.tensor([float(v.mean()) for v in seen], dtype=torch.float64)
    sigma = float(own[:-1].std(unbiased=False))
    coefficients = [(float(loss) - float(own[-1])) / (n * sigma) for loss in own[:-1]]
    assert all(torch.equal(ui.abs(), torch.ones_like(ui)) for u in us for ui in u)  # +-1 everywhere
    expected = [t - lr * sum(c * u[k] for c, u in zip(coefficients, us, strict=True)) for k, t in enumerate(theta)]
    assert_params(named, expected, theta, atol=float32_atol(n, theta))


@pytest.mark.parametrize("case", ["lora", "lora-dual", "full-ft"])
def test_es_step_is_the_references_z_scored_population_update(tiny, tiny64, case):
    """ES at scale (es_ops.apply_update, reward_shaping.z_score) with antithetic members and losses for rewards:
    theta -= lr / N sum_m (L_m - mean) / (std + 1e-8) e_m over the N = 2n members theta + eps e_m, e = +-z_i."""
    model, named = trained_params(tiny, tiny64, case == "full-ft")
    dual = dict(dual_modules={n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}) \
        if case == "lora-dual" else {}
    reference = copy.deepcopy(model)
    names, theta = [n for n, _ in named], state(named)
    batch = random_batch(tiny.config.vocab_size, seed=3)
    lr, eps, n = 1e-2, 1e-2, 3
    losses = ES(named, lr=lr, eps=eps, seed=8, queries=n, **dual).step(ce_loss_fn(model), batch)

    members = [(sign, reference_z(theta, s)) for s in step_seeds(8, n) for sign in (1.0, -1.0)]
    member_losses = torch.tensor([loss_at(reference, names, shifted(theta, z, sign * eps), batch)
                                  for sign, z in members], dtype=torch.float64)
    assert losses == pytest.approx(member_losses.tolist(), abs=2e-6)
    # shaped from the estimator's own losses: z-scoring divides their float32 rounding by a spread of ~1e-3, so the
    # recomputed losses would move the update by ~1e-6 on their own
    own = torch.tensor(losses, dtype=torch.float64)
    shaped = (own - own.mean()) / (own.std(unbiased=False) + 1e-8)
    expected = [t - lr / len(members) * sum(float(a) * sign * z[k] for a, (sign, z) in zip(shaped, members,
                                                                                             strict=True))
                for k, t in enumerate(theta)]
    assert_params(named, expected, theta, atol=float32_atol(len(members), theta))


def test_es_on_a_quadratic_is_the_exact_update_and_descends():
    """On L = 1/2 theta'A theta + b'theta, L(theta +- eps z) = L(theta) +- eps z'g + eps^2/2 z'Az exactly, so with
    the documented seeds the step has a closed form; 150 steps then remove most of the loss above the optimum."""
    a, b, start = quadratic_terms()
    theta = nn.Parameter(start.clone())

    def loss(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x @ a @ x + b @ x

    lr, eps, n = 0.05, 1e-3, 4
    estimator = ES([("theta", theta)], lr=lr, eps=eps, seed=5, queries=n)
    estimator.step(lambda batch: loss(theta).reshape(1), {})

    zs = [reference_z([start], s)[0] for s in step_seeds(5, n)]
    g = a @ start + b
    members = torch.stack([loss(start) + sign * eps * z @ g + 0.5 * eps**2 * z @ a @ z
                           for z in zs for sign in (1.0, -1.0)])
    std = float(members.std(unbiased=False))
    expected = start - lr * sum(float(members[2 * i] - members[2 * i + 1]) / (2 * n * (std + 1e-8)) * z
                                for i, z in enumerate(zs))
    torch.testing.assert_close(theta.detach(), expected, atol=1e-12, rtol=0)

    best = float(loss(torch.linalg.solve(a, -b)))
    for _ in range(150):
        estimator.step(lambda batch: loss(theta).reshape(1), {})
    assert float(loss(theta.detach())) - best < 0.1 * (float(loss(start)) - best)


def test_zo_estimator_es_builds_the_population_the_flags_ask_for():
    weight = nn.Parameter(torch.zeros(3))
    for queries, sampling, seeds in ((None, "antithetic", 15), (6, "antithetic", 6), (None, "independent", 30),
                                     (7, "independent", 7)):  # default: the reference's population of 30
        cfg = Config(trainer="zo", method="lora", zo_estimator="es", zo_queries=queries, zo_es_sampling=sampling)
        estimator = build_estimator(cfg, [("w", weight)], cfg.learning_rate, seed=0)
        assert (type(estimator), estimator.queries, estimator.sampling, estimator.share) == \
            (ES, seeds, sampling, (0, 1))
    assert parse_method("lora:es", "regular") == ("lora", "zo", "es")


def test_fzoo_leaves_the_weights_alone_when_all_perturbed_losses_are_equal():
    weight = nn.Parameter(torch.ones(4))
    estimator = FZOO([("weight", weight)], lr=1.0, eps=1e-3, queries=3)
    assert estimator.step(lambda batch: torch.ones(2), {}) == (1.0,)
    assert torch.equal(weight.detach(), torch.ones(4))


@pytest.mark.parametrize("anchor_scale", [1.0, 3.0], ids=["one-rate", "two-rates"])
@pytest.mark.parametrize("dual", [False, True], ids=["two-pass", "dual-batch"])
def test_svrg_anchor_then_variance_reduced_step(tiny, dual, anchor_scale):
    """Gautam et al.'s MeZO-SVRG with its two rates (the reference's learning_rate_aux eta_1 for the full-batch
    step, learning_rate eta_2 for the steps between): anchor theta_a, g_a on the large batch, theta -= eta_1 g_a
    z_a; then on a minibatch with one shared z, theta -= eta_2 ((g(theta) - g(theta_a)) z + g_a z_a)."""
    model, named, modules = lora_model(tiny)
    reference = copy.deepcopy(model)
    names, theta0 = [n for n, _ in named], state(named)
    vocab = tiny.config.vocab_size
    anchor_batches = [random_batch(vocab, seed=10), random_batch(vocab, seed=11)]
    batch = random_batch(vocab, seed=12)
    lr, eps = 1e-2, 1e-2
    estimator = MeZOSVRG(named, lr=lr, eps=eps, seed=8, period=3, anchor_batches=2, anchor_lr_scale=anchor_scale,
                         dual_modules=modules if dual else None)
    assert estimator.anchor_due()
    anchor_losses = estimator.anchor(ce_loss_fn(model), anchor_batches)
    assert not estimator.anchor_due()
    inner_losses = estimator.step(ce_loss_fn(model), batch)

    s_anchor, s = step_seeds(8, 2)
    z_a, z = reference_z(theta0, s_anchor), reference_z(theta0, s)
    a_plus = losses_at(reference, names, shifted(theta0, z_a, eps), anchor_batches)
    a_minus = losses_at(reference, names, shifted(theta0, z_a, -eps), anchor_batches)
    assert anchor_losses == pytest.approx((a_plus, a_minus), abs=2e-6)
    g_a = (a_plus - a_minus) / (2 * eps)
    theta1 = shifted(theta0, z_a, -anchor_scale * lr * g_a)
    plus = loss_at(reference, names, shifted(theta1, z, eps), batch)
    minus = loss_at(reference, names, shifted(theta1, z, -eps), batch)
    g = (plus - minus) / (2 * eps)
    g_tilde = (loss_at(reference, names, shifted(theta0, z, eps), batch)
               - loss_at(reference, names, shifted(theta0, z, -eps), batch)) / (2 * eps)
    assert inner_losses == pytest.approx((plus, minus), abs=2e-6)
    assert abs(g - g_tilde) > 1e-3 and abs(g - g_tilde) < 0.5 * abs(g)  # the anchor term cancels most of g
    expected = [t - lr * ((g - g_tilde) * zi + g_a * za) for t, zi, za in zip(theta1, z, z_a, strict=True)]
    # three projected gradients, each a difference of fp32 losses over 2 eps: a loss's rounding (~1e-7) moves a
    # weight by lr / (2 eps) x 1e-7 x |z| per loss, about 1e-6 in all here (seen: 1.06e-6 on one CPU, under
    # 1e-6 on another); 5e-6 is still a thousandth of the step (5.6e-3)
    assert_params(named, expected, theta0, atol=5e-6)


def test_svrg_anchor_learning_rate_is_eta_1_and_learning_rate_eta_2():
    """The reference script's rates, --zo_svrg_anchor_learning_rate 1e-3 (full batch) and --learning_rate 1e-6 (the
    steps between): the anchor steps at 1000x the scheduled rate; the option is refused off svrg."""
    weight = [("w", nn.Parameter(torch.zeros(3)))]
    cfg = Config(trainer="zo", zo_estimator="svrg", learning_rate=1e-6, zo_svrg_anchor_learning_rate=1e-3,
                 zo_svrg_period=4, zo_svrg_anchor_batches=3)
    estimator = build_estimator(cfg, weight, cfg.learning_rate, seed=0)
    assert (type(estimator), estimator.period, estimator.anchor_batches, stepper_type(estimator)) == \
        (MeZOSVRG, 4, 3, SVRGStepper)
    assert estimator.anchor_lr_scale == pytest.approx(1000.0)
    assert build_estimator(Config(trainer="zo", zo_estimator="svrg"), weight, 1e-6, seed=0).anchor_lr_scale == 1.0
    with pytest.raises(UserError, match="svrg only"):
        Config(trainer="zo", zo_svrg_anchor_learning_rate=1e-3)


def test_svrg_stepper_takes_an_anchor_every_period_steps(tiny):
    model, named, _ = lora_model(tiny)
    estimator = MeZOSVRG(named, lr=1e-3, eps=1e-3, seed=1, period=3, anchor_batches=2)
    drawn = []

    def next_batch():
        drawn.append(len(drawn))
        return random_batch(tiny.config.vocab_size, seed=len(drawn))

    stepper = SVRGStepper(estimator, ce_loss_fn(model))
    per_step = []
    for _ in range(7):
        before = len(drawn)
        stepper.step(next_batch, 1e-3)
        per_step.append(len(drawn) - before)
    assert per_step == [2, 1, 1, 2, 1, 1, 2]
    stepper.forget([p for _, p in named])  # a merged booster: the anchor is stale
    assert estimator.anchor_due()


def test_default_estimator_is_mezo_and_its_trajectory_is_the_formula_run(tiny64):
    """--zo_estimator's default builds MeZO (SGD, eps 1e-3) driven by ZOStepper; 5 steps equal the formula
    theta <- theta (1 - lr wd) - lr g z applied 5 times with the documented seeds (float64 full model)."""
    cfg = Config(trainer="zo", method="lora")
    model = copy.deepcopy(tiny64)
    named = list(model.named_parameters())
    reference = copy.deepcopy(model)
    names, theta = [n for n, _ in named], state(named)
    start = theta
    lr, eps, wd = 1e-3, 1e-3, 0.01
    estimator = build_estimator(cfg, named, lr, seed=5, weight_decay=wd)
    assert (type(estimator), stepper_type(estimator), estimator.eps) == (MeZO, ZOStepper, eps)
    stepper = ZOStepper(estimator, ce_loss_fn(model))
    batches = [random_batch(tiny64.config.vocab_size, seed=k) for k in range(5)]
    feed = iter(batches)
    for batch, s in zip(batches, step_seeds(5, 5), strict=True):
        reported = float(stepper.step(lambda: next(feed), lr))
        z = reference_z(theta, s)
        plus = loss_at(reference, names, shifted(theta, z, eps), batch)
        minus = loss_at(reference, names, shifted(theta, z, -eps), batch)
        assert reported == pytest.approx((plus + minus) / 2, abs=1e-6)  # reported as an fp32 tensor
        g = (plus - minus) / (2 * eps)
        theta = [t * (1 - lr * (0.0 if no_decay(n) else wd)) - lr * g * zi
                 for n, t, zi in zip(names, theta, z, strict=True)]
    assert_params(named, theta, start)


# ----------------------------------------------------------------------------- ZO-SGD-momentum and ZO-Adam


@pytest.mark.parametrize("penalty", [0.0, 0.05], ids=["no-penalty", "norm-penalty"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_zo_momentum_and_adam_follow_torchs_update_rules_on_the_mezo_estimate(tiny64, optimizer, penalty):
    """ZO-Bench's ZO-SGD-momentum / ZO-Adam: the optimizer fed g z as the gradient; written out here. Full
    fine-tuning in float64: Adam divides by the moments' size, which fp32 rounding of a near-cancelling m upsets.
    A penalty in the loss (XGBLoRA's lambda (|A|^2 + |B|^2), gradient 2 lambda theta) enters the gradient, as it
    does under first-order AdamW, not AdamW's decoupled decay."""
    model = copy.deepcopy(tiny64)
    named = list(model.named_parameters())
    reference = copy.deepcopy(model)
    names, theta = [n for n, _ in named], state(named)
    start = theta
    lr, eps, wd, (b1, b2), adam_eps = 1e-2, 1e-2, 0.1, (0.8, 0.9), 1e-8
    estimator = MeZO(named, lr=lr, eps=eps, weight_decay=wd, seed=2, optimizer=optimizer, betas=(b1, b2),
                     adam_eps=adam_eps, penalty=penalty)
    batches = [random_batch(tiny64.config.vocab_size, seed=k) for k in range(3)]
    decay = [0.0 if no_decay(name) else wd for name in names]
    m = [torch.zeros_like(t) for t in theta]
    v = [torch.zeros_like(t) for t in theta]
    for t_step, (batch, s) in enumerate(zip(batches, step_seeds(2, 3), strict=True), start=1):
        estimator.step(ce_loss_fn(model), batch)
        z = reference_z(theta, s)
        g = (loss_at(reference, names, shifted(theta, z, eps), batch)
             - loss_at(reference, names, shifted(theta, z, -eps), batch)) / (2 * eps)
        grads = [g * zi + (0.0 if no_decay(name) else penalty) * t
                 for zi, name, t in zip(z, names, theta, strict=True)]
        if optimizer == "momentum":  # torch SGD: buf = grad (first step) or b1 buf + grad; L2 decay in grad
            grads = [gr + d * t for gr, d, t in zip(grads, decay, theta, strict=True)]
            m = grads if t_step == 1 else [b1 * mi + gr for mi, gr in zip(m, grads, strict=True)]
            theta = [t - lr * mi for t, mi in zip(theta, m, strict=True)]
        else:  # AdamW: decoupled decay, bias-corrected moments
            m = [b1 * mi + (1 - b1) * gr for mi, gr in zip(m, grads, strict=True)]
            v = [b2 * vi + (1 - b2) * gr * gr for vi, gr in zip(v, grads, strict=True)]
            theta = [t * (1 - lr * d) - lr * (mi / (1 - b1**t_step))
                     / ((vi / (1 - b2**t_step)).sqrt() + adam_eps)
                     for t, d, mi, vi in zip(theta, decay, m, v, strict=True)]
    assert_params(named, theta, start)


def test_zo_adam_refuses_half_precision_weights():
    with pytest.raises(ValueError, match="bfloat16 weights would lose"):
        MeZO([("w", nn.Parameter(torch.ones(3, dtype=torch.bfloat16)))], lr=1.0, eps=1e-3, optimizer="adam")


# ----------------------------------------------------------------------------- expected direction on a quadratic


def quadratic_terms(d: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (positive definite, eigenvalues 0.5-2), b and a starting theta of the quadratic below, float64."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.linspace(0.5, 2.0, d, dtype=torch.float64)) @ q.T
    b = torch.randn(d, generator=gen, dtype=torch.float64)
    return a, b, torch.randn(d, generator=gen, dtype=torch.float64)


def quadratic() -> tuple[nn.Parameter, callable, torch.Tensor]:
    """L(theta) = 1/2 theta^T A theta + b^T theta (A positive definite); returns theta, loss_fn, the true gradient."""
    a, b, start = quadratic_terms()
    theta = nn.Parameter(start)

    def loss_fn(batch) -> torch.Tensor:
        return (0.5 * theta @ a @ theta + b @ theta).reshape(1)

    return theta, loss_fn, (a @ theta + b).detach()


DIRECTION_RUNS = {
    "mezo": lambda named, seed: MeZO(named, lr=1e-4, eps=1e-3, seed=seed),
    "nspsa": lambda named, seed: NSPSA(named, lr=1e-4, eps=1e-3, seed=seed, queries=4),
    "fzoo": lambda named, seed: FZOO(named, lr=1e-4, eps=1e-3, seed=seed, queries=8),
    "svrg": lambda named, seed: MeZOSVRG(named, lr=1e-4, eps=1e-3, seed=seed, period=5, anchor_batches=1),
    "es": lambda named, seed: ES(named, lr=1e-4, eps=1e-3, seed=seed, queries=4),
}


@pytest.mark.parametrize("name", list(DIRECTION_RUNS))
def test_expected_step_points_along_the_true_gradient(name):
    """The mean step over 1,000 seeds (each from the same theta) has cosine > 0.95 with the true gradient.

    For an unbiased Gaussian two-point estimate the mean of S steps has E|mean - grad|^2 = (d + 1)|grad|^2 / S,
    cosine ~ 1/sqrt(1 + 17/1000) = 0.99 at d = 16 (MeZO, SVRG's anchor term; n-SPSA is closer still); FZOO's step
    is normalised by the losses' spread, so only its direction is compared. A direction independent of the
    gradient has cosine ~ N(0, 1/16): above 0.95 with probability far below 1e-9."""
    theta, loss_fn, grad = quadratic()
    start = theta.detach().clone()
    total = torch.zeros_like(start)
    for seed in range(1000):
        estimator = DIRECTION_RUNS[name]([("theta", theta)], seed)
        if name == "svrg":  # anchor at start, then the variance-reduced step measured from there
            estimator.anchor(loss_fn, [{}])
        before = theta.detach().clone()
        estimator.step(loss_fn, {})
        total -= theta.detach() - before
        with torch.no_grad():
            theta.copy_(start)
    cosine = float(total @ grad / (total.norm() * grad.norm()))
    assert cosine > 0.95, cosine


# ----------------------------------------------------------------------------- state and resume


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_svrg_state_dict_mid_epoch_resumes_exactly(tiny, optimizer):
    """Saved after the anchor and one inner step, restored into a fresh estimator: the next steps are identical."""
    model, named, _ = lora_model(tiny)
    twin = copy.deepcopy(model)
    twin_named = [(n, p) for n, p in twin.named_parameters() if ".lora_" in n]
    vocab = tiny.config.vocab_size
    batches = [random_batch(vocab, seed=k) for k in range(8)]
    options = dict(lr=1e-2, eps=1e-3, period=4, anchor_batches=2, optimizer=optimizer)
    estimator = MeZOSVRG(named, seed=3, **options)
    estimator.anchor(ce_loss_fn(model), batches[:2])
    estimator.step(ce_loss_fn(model), batches[2])
    buffer = io.BytesIO()
    torch.save(estimator.state_dict(), buffer)  # checkpoints load blobs with weights_only=True
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    with torch.no_grad():
        for (_, p), (_, q) in zip(named, twin_named, strict=True):
            q.copy_(p)
    resumed = MeZOSVRG(twin_named, seed=999, **options)
    resumed.load_state_dict(saved)
    for k in (3, 4):
        assert estimator.step(ce_loss_fn(model), batches[k]) == resumed.step(ce_loss_fn(twin), batches[k])
    assert estimator.anchor_due() and resumed.anchor_due()
    for (name, p), (_, q) in zip(named, twin_named, strict=True):
        assert torch.equal(p, q), name


def test_stepper_reports_the_mean_of_the_estimators_losses():
    class Fixed:  # an estimator that measured three losses
        def step(self, loss_fn, batch, lr=None):
            return (1.0, 2.0, 4.0)

    assert float(ZOStepper(Fixed(), loss_fn=None).step(lambda: {}, 1e-3)) == pytest.approx(7 / 3)


def test_losses_are_reduced_over_ranks_before_the_estimate():
    """Seed-sharing data parallelism: each rank sends only its losses; the update uses their mean over ranks."""
    weight = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    sent = []

    def reduce(values):  # the other ranks' losses raise every mean by 0.5
        sent.append(values.clone())
        return values + 0.5

    estimator = FZOO([("weight", weight)], lr=1.0, eps=1e-3, seed=0, queries=3, reduce_losses=reduce)
    calls = iter([1.0, 2.0, 4.0, 0.0])
    assert estimator.step(lambda batch: torch.tensor([next(calls)], dtype=torch.float64), {}) == (0.5,)
    assert sent[0].tolist() == [1.0, 2.0, 4.0, 0.0]  # N + 1 numbers: all a worker sends per step
    sigma = math.sqrt(sum((x - 7 / 3) ** 2 for x in (1.0, 2.0, 4.0)) / 3)
    us = [reference_z([weight], s)[0].sign() for s in step_seeds(0, 3)]
    expected = -sum(x / (3 * sigma) * u for x, u in zip((1.0, 2.0, 4.0), us, strict=True))
    torch.testing.assert_close(weight.detach(), expected, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("overrides, message", [
    (dict(zo_estimator="fzoo", zo_dual=True), "fzoo perturbs one-sided"),
    (dict(zo_estimator="fzoo", zo_queries=1), "at least 2"),
    (dict(zo_estimator="mezo", zo_queries=4), "takes one perturbation per step"),
    (dict(method="ft", load_bfloat16=True, zo_optimizer="adam"), "load fp32 weights"),
    (dict(zo_estimator="nspsa", zo_es_sampling="independent"), "--zo_es_sampling independent: the population of "
                                                               "--zo_estimator es only, not nspsa"),
    (dict(zo_estimator="mezo", zo_es_spread="members"), "es only, not mezo"),
    (dict(zo_estimator="es", zo_es_sampling="independent", zo_dual=True), "independent perturbs one-sided"),
    (dict(zo_estimator="es", zo_es_spread="members"), "that is xgblora grpo --zo_objective reward"),
])
def test_flags_an_estimator_cannot_use_are_refused_with_the_reason(overrides, message):
    with pytest.raises(UserError, match=message):
        Config(**{"trainer": "zo", "method": "lora", **overrides})


def test_the_names_help_offers_are_the_registered_ones():
    """--zo_estimator's choices (options.ZO_ESTIMATORS, torch-free for --help and compare) are the registry's names;
    --zo_optimizer's and --zo_es_sampling's are the ones the estimators accept."""
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(ZOOptions)}
    assert choices["zo_estimator"] == ZO_ESTIMATORS and sorted(ZO_ESTIMATORS) == sorted(ESTIMATORS)
    assert (choices["zo_optimizer"], choices["zo_es_sampling"]) == (ZO_OPTIMIZERS, ES.SAMPLINGS)


@pytest.mark.parametrize("estimator, sampling, rows", [
    ("mezo", "antithetic", [8]), ("nspsa", "antithetic", [8, 8]), ("es", "antithetic", [8, 8]),
    ("fzoo", "antithetic", [4, 4, 4]), ("es", "independent", [4, 4])])
def test_the_doubled_batch_goes_to_the_estimators_that_perturb_in_pairs(tiny, estimator, sampling, rows):
    """Offered the adapters, an estimator of +z/-z pairs scores each pair in one forward over the doubled batch (8
    rows); FZOO's and independent ES's one-sided perturbations take one forward of the batch (4 rows) each. Built
    from the ZO options group alone."""
    model, named, modules = lora_model(tiny)
    seen = []
    loss = ce_loss_fn(model)
    zo = ZOOptions(zo_estimator=estimator, zo_queries=2, zo_es_sampling=sampling)
    built = build_estimator(zo, named, 1e-3, seed=0, dual_modules=modules)
    built.step(lambda batch: seen.append(batch.input_ids.shape[0]) or loss(batch), random_batch(tiny.config.vocab_size, seed=0))
    assert (type(built), seen) == (ESTIMATORS[estimator], rows)


def test_es_spread_over_the_processes_takes_this_processs_share_and_sums_the_losses():
    """--zo_es_spread members (trainer zo, estimator es): the process scores its share (rank, world) of the
    population and its losses are summed over the processes, not averaged; elsewhere, the whole population."""

    class Rank1Of2:
        rank, world_size = 1, 2

        def zo_losses(self, total: bool):
            summed.append(total)
            return lambda values: values

    summed: list[bool] = []
    weight = [("w", nn.Parameter(torch.zeros(3)))]
    spread, prompts = ZOOptions(zo_estimator="es", zo_es_spread="members"), ZOOptions(zo_estimator="es")
    shares = [build_estimator(zo, weight, 1e-3, seed=0, dist=Rank1Of2()).share for zo in (spread, prompts)]
    assert (shares, summed) == ([(1, 2), (0, 1)], [True, False])
    assert [spreads_members(spread, trainer) for trainer in ("zo", "regular")] == [True, False]
    assert not spreads_members(ZOOptions(zo_estimator="mezo", zo_es_spread="members"), "zo")


def test_compare_accepts_estimators_as_trainers():
    assert parse_method("lora:fzoo", "regular") == ("lora", "zo", "fzoo")
    assert parse_method("xgblora:svrg", "regular") == ("xgblora", "zo", "svrg")
    assert parse_method("lora", "zo") == ("lora", "zo", None)
    with pytest.raises(UserError, match="nspsa"):
        parse_method("lora:spsa", "zo")


def test_es_leaves_members_without_a_finite_loss_out_of_the_population():
    """A member whose loss is NaN (a policy none of whose completions was scored) is left out: the update is the
    reference's z-scored sum over the other members, divided by their count; with none left, no step."""
    a, b, start = quadratic_terms()
    theta = nn.Parameter(start.clone())
    lr, eps, n = 0.05, 1e-3, 3
    calls = []

    def loss(batch) -> torch.Tensor:  # the third member (the second pair's +) is unscored
        calls.append(None)
        value = 0.5 * theta @ a @ theta + b @ theta
        return (value * math.nan if len(calls) == 3 else value).reshape(1)

    reported = ES([("theta", theta)], lr=lr, eps=eps, seed=5, queries=n).step(loss, {})
    zs = [reference_z([start], s)[0] for s in step_seeds(5, n)]
    members = [(sign, z) for z in zs for sign in (1.0, -1.0)]
    values = torch.tensor([float(0.5 * (start + sign * eps * z) @ a @ (start + sign * eps * z)
                                 + b @ (start + sign * eps * z)) for sign, z in members], dtype=torch.float64)
    scored = [m for m in range(2 * n) if m != 2]
    shaped = (values[scored] - values[scored].mean()) / (values[scored].std(unbiased=False) + 1e-8)
    expected = start - lr / len(scored) * sum(float(s) * members[m][0] * members[m][1]
                                              for s, m in zip(shaped, scored, strict=True))
    assert reported == pytest.approx(values[scored].tolist(), rel=1e-9)
    torch.testing.assert_close(theta.detach(), expected.to(theta), atol=1e-12, rtol=0)

    nothing = ES([("theta", theta)], lr=lr, eps=eps, seed=5, queries=n)
    before = theta.detach().clone()
    assert nothing.step(lambda batch: (theta.sum() * math.nan).reshape(1), {}) == ()
    torch.testing.assert_close(theta.detach(), before, atol=1e-12, rtol=0)  # perturbed and restored only


def quadratic_members(start: torch.Tensor, signs: tuple[float, ...], n: int, eps: float
                      ) -> tuple[list[tuple[float, torch.Tensor]], torch.Tensor]:
    """The members (sign, z) of ES(seed=5)'s first step on the quadratic of quadratic_terms, and their losses."""
    a, b, _ = quadratic_terms()
    members = [(sign, z) for s in step_seeds(5, n) for z in reference_z([start], s) for sign in signs]
    points = [start + sign * eps * z for sign, z in members]
    return members, torch.tensor([float(0.5 * x @ a @ x + b @ x) for x in points], dtype=torch.float64)


def test_es_independent_members_are_the_references_one_sided_z_scored_update():
    """--zo_es_sampling independent: N one-sided members theta + eps z_m, one seed each, and
    theta <- theta - lr / N sum_m zscore(L_m) z_m over the members with a finite loss (here the third has none);
    150 steps descend; with no member scored, no step."""
    a, b, start = quadratic_terms()
    theta = nn.Parameter(start.clone())
    lr, eps, n = 0.05, 1e-3, 6
    calls = []

    def loss(batch) -> torch.Tensor:
        calls.append(None)
        value = 0.5 * theta @ a @ theta + b @ theta
        return (value * math.nan if len(calls) == 3 else value).reshape(1)

    estimator = ES([("theta", theta)], lr=lr, eps=eps, seed=5, queries=n, sampling="independent")
    reported = estimator.step(loss, {})
    members, values = quadratic_members(start, (1.0,), n, eps)
    scored = [m for m in range(n) if m != 2]
    shaped = (values[scored] - values[scored].mean()) / (values[scored].std(unbiased=False) + 1e-8)
    expected = start - lr / len(scored) * sum(float(s) * members[m][1] for s, m in zip(shaped, scored, strict=True))
    assert len(calls) == n and reported == pytest.approx(values[scored].tolist(), rel=1e-9)
    torch.testing.assert_close(theta.detach(), expected, atol=1e-12, rtol=0)

    best = float(0.5 * torch.linalg.solve(a, -b) @ b)
    start_gap = float(0.5 * start @ a @ start + b @ start) - best
    for _ in range(150):
        estimator.step(lambda batch: (0.5 * theta @ a @ theta + b @ theta).reshape(1), {})
    end = theta.detach()
    assert float(0.5 * end @ a @ end + b @ end) - best < 0.1 * start_gap

    before = theta.detach().clone()
    assert estimator.step(lambda batch: (theta.sum() * math.nan).reshape(1), {}) == ()
    torch.testing.assert_close(theta.detach(), before, atol=1e-12, rtol=0)  # perturbed and restored only


@pytest.mark.parametrize("sampling", ["antithetic", "independent"])
def test_es_shared_out_over_two_processes_scores_each_member_once_and_steps_as_one(sampling):
    """share (rank, world): a process scores the members of seeds k % world == rank only (whole pairs), 0 for the
    others'; the sum over the processes (here: rank 1's vector kept and added to rank 0's) is the population's
    losses, and both processes step as one process does."""
    a, b, start = quadratic_terms()
    thetas = [nn.Parameter(start.clone()) for _ in range(3)]
    scored: list[list[int]] = [[], [], []]

    def loss_of(k: int):
        def loss(batch) -> torch.Tensor:
            scored[k].append(None)
            return (0.5 * thetas[k] @ a @ thetas[k] + b @ thetas[k]).float().reshape(1)  # as rewards are
        return loss

    options = dict(lr=0.05, eps=1e-3, seed=5, queries=3, sampling=sampling)
    ES([("theta", thetas[0])], **options).step(loss_of(0), {})
    sent = []
    ES([("theta", thetas[2])], share=(1, 2), reduce_losses=lambda v: sent.append(v) or v, **options).step(
        loss_of(2), {})
    reported = ES([("theta", thetas[1])], share=(0, 2), reduce_losses=lambda v: v + sent[0], **options).step(
        loss_of(1), {})
    members = 2 if sampling == "antithetic" else 1
    assert (len(scored[0]), len(scored[1]), len(scored[2])) == (3 * members, 2 * members, members)
    assert sent[0].dtype == torch.float32 and sent[0].shape == (3 * members,)
    assert sent[0][:members].eq(0).all() and sent[0][2 * members:].eq(0).all()  # rank 0's seeds 0 and 2
    assert len(reported) == 3 * members
    torch.testing.assert_close(thetas[1].detach(), thetas[0].detach(), atol=1e-9, rtol=0)
