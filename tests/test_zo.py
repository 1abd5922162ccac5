"""MeZO (optim/zo.py) against references written here from the formulas and the documented z convention."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from helpers import adapted, ce_loss_fn, loss_at, no_decay, random_batch, reference_z, step_seeds
from torch import nn

from xgblora.models.pretrained import load
from xgblora.optim import zo
from xgblora.optim.zo import MeZO, stochastic_round

# ----------------------------------------------------------------------------- references from the docs


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    """tiny-opt in fp32 and eval mode (dropout off, as MeZO's forwards run)."""
    model, _ = load("tiny-opt")
    return model.eval()


# ----------------------------------------------------------------------------- one step by hand


def check_one_step(model: nn.Module, named: list[tuple[str, nn.Parameter]], lr: float, eps: float, wd: float,
                   seed: int) -> None:
    """One MeZO step against the hand computation: seeds, z, L+, L-, g and every updated weight."""
    reference = copy.deepcopy(model)
    trainable = [(n, p) for n, p in named if p.requires_grad]
    names = [n for n, _ in trainable]
    theta0 = [p.detach().clone() for _, p in trainable]
    frozen0 = {n: p.detach().clone() for n, p in model.named_parameters() if n not in names}
    batch = random_batch(model.config.vocab_size, seed=seed)

    mezo = MeZO(named, lr=lr, eps=eps, weight_decay=wd, seed=seed)
    plus, minus = mezo.step(ce_loss_fn(model), batch)

    (s,) = step_seeds(seed, 1)
    assert mezo.last_seed == s
    z = reference_z(theta0, s)
    ref_plus = loss_at(reference, names, [t + eps * zi for t, zi in zip(theta0, z, strict=True)], batch)
    ref_minus = loss_at(reference, names, [t - eps * zi for t, zi in zip(theta0, z, strict=True)], batch)
    g = (ref_plus - ref_minus) / (2 * eps)
    assert plus == pytest.approx(ref_plus, abs=2e-6)
    assert minus == pytest.approx(ref_minus, abs=2e-6)
    assert mezo.projected_grad == pytest.approx(g, rel=2e-3, abs=2e-3)
    assert abs(g) > 0.05  # the step is not a no-op, so the comparisons below mean something

    now = {n: p.detach() for n, p in model.named_parameters()}
    for name, t, zi in zip(names, theta0, z, strict=True):
        expected = t - lr * (g * zi + (0.0 if no_decay(name) else wd) * t)
        torch.testing.assert_close(now[name], expected, atol=1e-6, rtol=0, msg=name)
        wanted = (expected - t).norm()  # and relative to the size of the update itself:
        assert (now[name] - expected).norm() <= 2e-3 * wanted + 1e-6, (name, wanted)
    for name, t in frozen0.items():
        assert torch.equal(now[name], t), f"{name} is frozen and must not change"


@pytest.mark.parametrize("chunk", [None, 64], ids=["whole", "cpu-pieces-of-64"])
def test_one_step_full_model_matches_hand_computation(tiny, chunk, monkeypatch):
    if chunk is not None:  # every tiny-opt weight of 128 elements or more is then drawn in pieces
        monkeypatch.setattr(zo, "_CHUNK", chunk)
    model = copy.deepcopy(tiny)
    check_one_step(model, list(model.named_parameters()), lr=1e-3, eps=1e-3, wd=0.1, seed=11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_z_pieces_are_the_whole_tensor_draw(dtype, monkeypatch):
    """The reused-buffer pieces concatenate to torch.normal over each whole weight, in order, bit for bit."""
    monkeypatch.setattr(zo, "_CHUNK", 32)
    shapes = [(5,), (16,), (63,), (8, 8), (4, 33), (7, 29), (1000,), (3, 5)]
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
    mezo = MeZO([(f"w{i}", p) for i, p in enumerate(params)], lr=0.0, eps=1.0)
    gens = mezo._seeded({}, [(p, True) for p in params], 1234)
    drawn = []
    for p in params:
        pieces = [(piece, z.clone()) for piece, z in mezo._z_pieces(p, gens)]
        n = p.numel()
        sizes = [n] if n < 64 else [32] * (n // 32 - 1) + [n - 32 * (n // 32 - 1)]  # the last takes the rest
        assert [piece.numel() for piece, _ in pieces] == sizes
        assert [piece.data_ptr() for piece, _ in pieces] == [p.data_ptr() + k * 32 * p.element_size()
                                                              for k in range(len(sizes))]
        drawn.append(torch.cat([z.flatten() for _, z in pieces]).view(p.shape))
    for p, z, want in zip(params, drawn, reference_z(params, 1234), strict=True):
        assert torch.equal(z, want), p.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_whole_z_is_its_pieces(dtype, monkeypatch):
    """The dual and momentum paths draw z whole, the sweeps in pieces: both must be the same z on any device
    (on a GPU the pieces are not the whole-tensor draw, so the whole z is built from them)."""
    monkeypatch.setattr(zo, "_CHUNK", 32)
    p = nn.Parameter(torch.zeros(10, 100, dtype=dtype))
    mezo = MeZO([("w", p)], lr=0.0, eps=1.0)
    whole = mezo._z(p, mezo._seeded({}, [(p, True)], 99))
    pieces = [z.clone() for _, z in mezo._z_pieces(p, mezo._seeded({}, [(p, True)], 99))]
    assert len(pieces) == 1000 // 32  # 30 of 32 elements, the last of 40
    assert torch.equal(whole, torch.cat(pieces).view(p.shape))


def test_a_half_precision_update_rounds_piece_by_piece(monkeypatch):
    """The fp32 copies of a bf16 update never exceed a piece (not the whole embedding), and the update is the
    hand computation's to within a bf16 rounding."""
    monkeypatch.setattr(zo, "_CHUNK", 64)
    rounded = []
    real = zo.stochastic_round
    monkeypatch.setattr(zo, "stochastic_round", lambda x, *a: rounded.append(x.numel()) or real(x, *a))
    theta0 = torch.randn(40, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    p = nn.Parameter(theta0.clone())
    losses = iter([torch.tensor([2.0]), torch.tensor([1.0])])
    lr, eps = 1e-2, 1e-3
    MeZO([("w", p)], lr=lr, eps=eps, seed=3).step(lambda batch: next(losses), {})
    assert rounded and max(rounded) < 2 * 64 and sum(rounded) == p.numel()
    (s,) = step_seeds(3, 1)
    z = reference_z([theta0], s)[0].float()
    expected = theta0.float() - lr * (1.0 / (2 * eps)) * z
    ulp = 2.0 ** torch.floor(torch.log2(expected.abs())) * 2.0**-7
    assert bool(((p.detach().float() - expected).abs() <= ulp).all())


@pytest.mark.parametrize("r, active_every", [(4, 1), (1, 2)], ids=["lora-r4", "xgblora-r1-half-the-layers"])
def test_one_step_adapters_matches_hand_computation(tiny, r, active_every):
    model, _ = adapted(tiny, r, active_every)
    named = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    check_one_step(model, named, lr=1e-2, eps=1e-3, wd=0.05, seed=5)


# ----------------------------------------------------------------------------- dual-batch path


@pytest.mark.parametrize("r, active_every", [(4, 1), (1, 2)], ids=["lora-r4", "xgblora-r1-half-the-layers"])
def test_dual_batch_equals_two_pass(tiny, r, active_every):
    two_model, _ = adapted(tiny, r, active_every)
    dual_model, dual_modules = adapted(tiny, r, active_every)
    named_two = [(n, p) for n, p in two_model.named_parameters() if ".lora_" in n]
    named_dual = [(n, p) for n, p in dual_model.named_parameters() if ".lora_" in n]
    start = [p.detach().clone() for _, p in named_two]
    two = MeZO(named_two, lr=5e-3, eps=1e-3, weight_decay=0.01, seed=3)
    dual = MeZO(named_dual, lr=5e-3, eps=1e-3, weight_decay=0.01, dual_modules=dual_modules, seed=3)
    vocab = tiny.config.vocab_size
    for step in range(20):
        batch = random_batch(vocab, seed=100 + step)
        p_two, m_two = two.step(ce_loss_fn(two_model), batch)
        p_dual, m_dual = dual.step(ce_loss_fn(dual_model), batch)
        # same weights on the first step: equal to a few fp32 ulps of L (~6); later the two trajectories drift
        # apart by rounding (g is quantised to ulp(L) / 2 eps ~ 2.4e-4), so the bound widens. A much larger lr
        # makes the drift grow step by step (each g difference feeds the next), so lr stays moderate here.
        tolerance = 2e-6 if step == 0 else 2e-5
        assert p_dual == pytest.approx(p_two, abs=tolerance), step
        assert m_dual == pytest.approx(m_two, abs=tolerance), step
        assert dual.projected_grad == pytest.approx(two.projected_grad, abs=5e-3), step
    assert all(m._member_A is None for m in dual_modules.values())  # left member mode after each step
    moved = max(float((p.detach() - s).abs().max()) for (_, p), s in zip(named_two, start, strict=True))
    assert moved > 0.02
    for (name, p_two), (_, p_dual) in zip(named_two, named_dual, strict=True):
        torch.testing.assert_close(p_dual, p_two, atol=1e-4, rtol=0, msg=name)


def test_dual_batch_rejects_non_adapter_weights(tiny):
    model, modules = adapted(tiny, 2)
    with pytest.raises(ValueError, match="adapter weights only"):
        MeZO(list(model.named_parameters()), lr=1e-3, eps=1e-3, dual_modules=modules)


# ----------------------------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_round_is_unbiased_between_neighbours(dtype):
    gen = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(200, generator=gen) < 0.5, -1.0, 1.0)
    base = torch.empty(200).uniform_(0.5, 4.0, generator=gen) * signs
    exact = base.to(dtype).float()  # already representable: must never move
    repeats = 4000
    x = torch.cat([base, exact]).repeat(repeats, 1)
    out = stochastic_round(x, dtype, torch.Generator().manual_seed(1))
    assert out.dtype == dtype
    ulp = 2.0 ** torch.floor(torch.log2(x.abs())) * torch.finfo(dtype).eps  # spacing at |x| (no subnormals)
    assert bool(((out.float() - x).abs() < ulp).all())  # only the two neighbours of x occur
    assert torch.equal(out[:, 200:].float(), x[:, 200:])
    mean = out.float().double().mean(dim=0)
    # each draw is a Bernoulli(p) pick between neighbours one ulp apart: std of the mean <= ulp / (2 sqrt(n))
    bound = 5 * ulp[0].double() / (2 * math.sqrt(repeats))
    assert bool(((mean - x[0].double()).abs() <= bound).all())
    nearest = x.to(dtype)
    assert not torch.equal(out, nearest)  # it does not just round to nearest


def test_bf16_stochastic_round_rounds_up_by_the_lower_bits_and_keeps_specials():
    """P(round away from zero) is the dropped lower 16 bits / 2^16; +-inf, NaN, zeros and bf16 values stay."""
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1.5, -3.0, 2.0**-130])
    out = stochastic_round(specials.repeat(100), torch.bfloat16, torch.Generator().manual_seed(0)).float()
    assert torch.equal(out.view(100, -1).isnan(), specials.isnan().repeat(100, 1))
    finite = ~specials.isnan()
    assert torch.equal(out.view(100, -1)[:, finite], specials[finite].repeat(100, 1))
    assert bool(out.view(100, -1)[:, 4].signbit().all()) and not bool(out.view(100, -1)[:, 3].signbit().any())
    n = 40000
    for low in (0x4000, 0xC000, 0x0001):
        x = torch.tensor([0x3FC00000 + low, -(2**31) + 0x3FC00000 + low], dtype=torch.int32).view(torch.float32)
        up = stochastic_round(x.repeat(n), torch.bfloat16, torch.Generator().manual_seed(low)).float().view(n, 2)
        away = (up.abs() > x.abs()).double().mean(dim=0)
        p = low / 2**16
        assert bool(((away - p).abs() <= 5 * math.sqrt(p * (1 - p) / n) + 1e-4).all()), (low, away)
    top = torch.tensor(torch.finfo(torch.bfloat16).max).float().view(torch.int32) + 0x8000  # half-way to inf
    assert set(stochastic_round(top.view(torch.float32).repeat(1000), torch.bfloat16).float().tolist()) == {
        float(torch.finfo(torch.bfloat16).max), math.inf}


def test_sub_ulp_updates_survive_on_average_in_bf16():
    """1000 MeZO updates, |lr g z| <= ulp/2 for |z| <= 8: SR tracks the fp32 result; nearest stays put."""
    n, steps, eps = 16384, 1000, 1e-4
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.empty(n).uniform_(1.25, 1.75, generator=gen).to(torch.bfloat16)
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    d = 2 * eps * ulp / 16  # so that g = d / (2 eps) and lr g = ulp / 16 with lr = 1
    results = {}
    for sr in (True, False):
        weight = nn.Parameter(theta0.clone())
        calls = [0]

        def loss_fn(batch, calls=calls):  # L+ = 1 + d, L- = 1: a fixed g, no model needed
            calls[0] += 1
            return torch.tensor([1.0 + d if calls[0] % 2 else 1.0], dtype=torch.float64)

        mezo = MeZO([("weight", weight)], lr=1.0, eps=eps, stochastic_rounding=None if sr else False, seed=4)
        for _ in range(steps):
            mezo.step(loss_fn, {})
        results[sr] = weight.detach().double()
    g = d / (2 * eps)
    exact = theta0.double().clone()
    for s in step_seeds(4, steps):  # the fp32 (here fp64) trajectory with the same z
        exact -= g * reference_z([theta0], s)[0].double()
    assert torch.equal(results[False], theta0.double())  # every update is below half an ulp: all lost
    moved, wanted = results[True] - theta0.double(), exact - theta0.double()
    assert float(wanted.abs().mean()) > ulp  # the fp32 result moves the weights by over an ulp on average
    slope = float((moved * wanted).sum() / (wanted * wanted).sum())
    # residual per weight: 1000 Bernoulli roundings, p = |z|/16, variance ~ 1000 E[p(1-p)] ulp^2 ~ 50 ulp^2,
    # std ~7 ulp; wanted has ~2 ulp std, so the slope's std is ~7 / (2 sqrt(n)) ~ 0.03: 0.15 is 5 sigma
    assert slope == pytest.approx(1.0, abs=0.15)
    assert float((moved - wanted).mean()) == pytest.approx(0.0, abs=5 * 7 * ulp / math.sqrt(n))


def test_bf16_full_model_step_runs_and_moves_weights(tiny):
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    mezo = MeZO(list(model.named_parameters()), lr=1e-4, eps=1e-3, seed=0)
    plus, minus = mezo.step(ce_loss_fn(model), random_batch(tiny.config.vocab_size, seed=0))
    assert math.isfinite(plus) and math.isfinite(minus) and plus != minus
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


# ----------------------------------------------------------------------------- the estimate itself


def test_mean_estimate_points_along_the_gradient(tiny):
    """Mean of N estimates g z: cosine ~ 1/sqrt(1 + (d+1)/N) with the gradient; random ones ~ 1/sqrt(d)."""
    model = copy.deepcopy(tiny)
    for p in model.parameters():
        p.requires_grad_(False)
    chosen = ["model.decoder.layers.1.self_attn.out_proj.weight", "model.decoder.final_layer_norm.weight",
              "model.decoder.final_layer_norm.bias"]
    params = dict(model.named_parameters())
    named = [(n, params[n]) for n in chosen]
    for _, p in named:
        p.requires_grad_(True)
    batch = random_batch(tiny.config.vocab_size, seed=9, rows=8)
    loss_fn = ce_loss_fn(model)
    loss_fn(batch).mean().backward()
    grad = torch.cat([p.grad.flatten() for _, p in named]).double()
    d, n_steps = grad.numel(), 200

    mezo = MeZO(named, lr=0.0, eps=1e-3, seed=1)  # lr 0: estimates only, the weights stay put
    estimate = torch.zeros(d, dtype=torch.float64)
    for _ in range(n_steps):
        mezo.step(loss_fn, batch)
        z = torch.cat([t.flatten() for t in reference_z([p for _, p in named], mezo.last_seed)]).double()
        estimate += mezo.projected_grad * z / n_steps
    cosine = float(estimate @ grad / (estimate.norm() * grad.norm()))
    expected = 1 / math.sqrt(1 + (d + 1) / n_steps)  # E|mean - grad|^2 = (d + 1) |grad|^2 / N for Gaussian z
    # a direction independent of grad has cosine ~ N(0, 1/d): above 5/sqrt(d) with probability < 3e-7
    assert cosine > 5 / math.sqrt(d)
    assert cosine == pytest.approx(expected, rel=0.5)


# ----------------------------------------------------------------------------- decay, safety, resume


def test_weight_decay_skips_biases_and_norms(tiny):
    model = copy.deepcopy(tiny)
    named = list(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named}
    lr, wd = 0.1, 0.5
    mezo = MeZO(named, lr=lr, eps=1e-3, weight_decay=wd, seed=0)
    mezo.step(lambda batch: torch.zeros(2), {})  # flat loss: g = 0, only decay acts
    assert mezo.projected_grad == 0.0
    assert any(no_decay(n) for n, _ in named) and not all(no_decay(n) for n, _ in named)
    for name, p in named:
        factor = 1.0 if no_decay(name) else 1.0 - lr * wd
        torch.testing.assert_close(p.detach(), before[name] * factor, atol=1e-6, rtol=0, msg=name)


def test_error_in_a_forward_restores_the_weights(tiny):
    model = copy.deepcopy(tiny)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def failing(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return torch.ones(1)

    mezo = MeZO(list(model.named_parameters()), lr=1.0, eps=1e-2, seed=0)
    with pytest.raises(RuntimeError, match="boom"):
        mezo.step(failing, {})
    for p, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), b, atol=1e-6, rtol=0)


def test_non_finite_estimate_leaves_weights_alone(tiny):
    model = copy.deepcopy(tiny)
    before = [p.detach().clone() for p in model.parameters()]
    mezo = MeZO(list(model.named_parameters()), lr=1.0, eps=1e-2, weight_decay=0.1, seed=0)
    plus, minus = mezo.step(lambda batch: torch.tensor([float("nan")]), {})
    assert math.isnan(plus) and math.isnan(mezo.projected_grad)
    for p, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), b, atol=1e-6, rtol=0)


def test_state_dict_round_trip_resumes_the_same_seeds(tiny):
    model = copy.deepcopy(tiny)
    loss_fn = ce_loss_fn(model)
    batches = [random_batch(tiny.config.vocab_size, seed=s) for s in range(5)]
    mezo = MeZO(list(model.named_parameters()), lr=1e-3, eps=1e-3, seed=21)
    seen = []
    for b in batches[:3]:
        mezo.step(loss_fn, b)
        seen.append(mezo.last_seed)
    buffer = io.BytesIO()
    torch.save(mezo.state_dict(), buffer)  # checkpoints load blobs with weights_only=True
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = copy.deepcopy(model)
    for b in batches[3:]:
        mezo.step(loss_fn, b)
        seen.append(mezo.last_seed)
    assert seen == step_seeds(21, 5)

    resumed = MeZO(list(resumed_model.named_parameters()), lr=1e-3, eps=1e-3, seed=999)
    resumed.load_state_dict(saved)
    assert resumed.last_seed == seen[2]
    for b, s in zip(batches[3:], seen[3:], strict=True):
        resumed.step(ce_loss_fn(resumed_model), b)
        assert resumed.last_seed == s
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
