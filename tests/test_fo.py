"""optim/fo.py: decay groups, AdamW construction, schedules against hand formulas, clipping."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import get_scheduler

from xgblora.config import Config
from xgblora.errors import UserError
from xgblora.optim.fo import build_optimizer, clip_grad_norm, param_groups
from xgblora.optim.schedule import Schedule

NAMES = {  # name -> gets weight decay
    "model.decoder.embed_tokens.weight": True,
    "model.decoder.layers.0.self_attn.q_proj.weight": True,
    "model.decoder.layers.0.self_attn.q_proj.bias": False,
    "model.decoder.layers.0.self_attn.v_proj.lora_A": True,
    "model.decoder.layers.0.self_attn.v_proj.lora_B": True,
    "model.decoder.layers.0.self_attn_layer_norm.weight": False,
    "model.decoder.final_layer_norm.bias": False,
    "model.layers.0.input_layernorm.weight": False,
    "model.layers.0.post_attention_layernorm.weight": False,
    "model.norm.weight": False,
    "transformer.h.0.ln_1.weight": False,
    "transformer.ln_f.weight": False,
    "transformer.h.0.mlp.c_fc.weight": True,
}


def named_params() -> list[tuple[str, nn.Parameter]]:
    """One small parameter per name in NAMES."""
    gen = torch.Generator().manual_seed(0)
    return [(name, nn.Parameter(torch.randn(3, 2, generator=gen))) for name in NAMES]


def test_param_groups_leave_biases_and_norms_undecayed():
    named = named_params()
    groups = param_groups(named, weight_decay=0.1)
    by_id = {id(p): name for name, p in named}
    decayed = {by_id[id(p)] for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    plain = {by_id[id(p)] for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decayed == {n for n, d in NAMES.items() if d}
    assert plain == {n for n, d in NAMES.items() if not d}
    assert sum(len(g["params"]) for g in groups) == len(named)


def test_param_groups_drop_empty_groups():
    only_bias = [("x.bias", nn.Parameter(torch.zeros(2)))]
    assert [g["weight_decay"] for g in param_groups(only_bias, 0.1)] == [0.0]


def test_build_optimizer_on_cpu_is_fused_and_matches_plain_adamw():
    named = named_params()
    reference = [(n, nn.Parameter(p.detach().clone())) for n, p in named]
    opt = build_optimizer(named, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    assert opt.defaults["fused"] is True  # measured fastest on the CPU (see fo.py)
    ref_opt = torch.optim.AdamW([{"params": [p for n, p in reference if NAMES[n]], "weight_decay": 0.1},
                                 {"params": [p for n, p in reference if not NAMES[n]], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.8, 0.99), eps=1e-6, foreach=False)
    for step in range(3):
        for (_, p), (_, q) in zip(named, reference, strict=True):
            g = torch.full_like(p, 0.5 + step) * torch.arange(p.numel()).view_as(p)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for (name, p), (_, q) in zip(named, reference, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


class RecordingAdamW:
    """Stands in for torch.optim.AdamW: keeps the keyword arguments it was built with."""

    def __init__(self, groups, **kwargs):
        self.groups, self.kwargs = groups, kwargs


def fake_params(*device_types: str) -> list[tuple[str, SimpleNamespace]]:
    """Objects with only a .device, as build_optimizer's device check sees them (no CUDA needed)."""
    return [(f"w{i}.weight", SimpleNamespace(device=torch.device(t))) for i, t in enumerate(device_types)]


@pytest.mark.parametrize("devices, expected", [(("cuda", "cuda"), True), (("cpu",), True),
                                               (("cuda", "cpu"), False), (("meta",), False)])
def test_build_optimizer_picks_fused_by_device(monkeypatch, devices, expected):
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    opt = build_optimizer(fake_params(*devices), lr=1e-3)
    assert opt.kwargs["fused"] is expected
    assert build_optimizer(fake_params(*devices), lr=1e-3, fused=False).kwargs["fused"] is False


def schedule(kind: str, max_steps: int, warmup: int, lr: float = 0.1) -> list[float]:
    """Learning rate at steps 0..max_steps as the loop reads it (the rate of the update after `step` steps)."""
    return [Schedule(kind, lr, max_steps, warmup)(step) for step in range(max_steps + 1)]


def hf_schedule(kind: str, max_steps: int, warmup: int, lr: float) -> list[float]:
    """transformers.get_scheduler's rates over the same steps (scheduler.step() after each optimizer step)."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[kind]
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=max_steps)
    out = []
    for _ in range(max_steps + 3):  # past the end too: the rate stays at the schedule's floor
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("max_steps, warmup", [(1, 0), (10, 0), (10, 3), (37, 7), (5, 9)])
def test_schedule_equals_transformers_get_scheduler_bit_for_bit(kind, max_steps, warmup):
    want = hf_schedule(kind, max_steps, warmup, lr=0.123)
    assert [Schedule(kind, 0.123, max_steps, warmup)(step) for step in range(len(want))] == want


def hand(kind: str, step: int, max_steps: int, warmup: int, lr: float = 0.1) -> float:
    """The schedules written out: linear warm-up, then constant / linear to 0 / half-cosine to 0."""
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (max_steps - warmup)
    if kind == "constant":
        return lr
    if kind == "linear":
        return lr * max(0.0, 1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedules_match_hand_formulas(kind, warmup):
    max_steps = 10
    got = schedule(kind, max_steps, warmup)
    want = [hand(kind, k, max_steps, warmup) for k in range(max_steps + 1)]
    assert got == pytest.approx(want, abs=1e-12)
    if kind != "constant":
        assert got[-1] == pytest.approx(0.0, abs=1e-12)
    if warmup:
        assert got[0] == 0.0 and got[warmup] == pytest.approx(0.1)


def test_unknown_schedule_is_a_user_error():
    with pytest.raises(UserError, match="lr_scheduler_type"):
        Config(lr_scheduler_type="polynomial")
    with pytest.raises(ValueError, match="polynomial"):
        Schedule("polynomial", 0.1, 10)


def test_clip_grad_norm_scales_to_max_norm_and_returns_the_tensor():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # global norm 5
    norm = clip_grad_norm([a, b], max_norm=1.0)
    assert isinstance(norm, torch.Tensor) and float(norm) == pytest.approx(5.0)
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(b.grad, torch.tensor([0.8]), atol=1e-5, rtol=0)
    a.grad = torch.tensor([0.3, 0.4])
    b.grad = torch.tensor([0.0])
    norm = clip_grad_norm(iter([a, b]), max_norm=1.0)  # under the limit: unchanged
    assert float(norm) == pytest.approx(0.5)
    torch.testing.assert_close(a.grad, torch.tensor([0.3, 0.4]))


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_clip_grad_norm_off(max_norm):
    a = nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([100.0])
    assert clip_grad_norm([a], max_norm) is None
    assert float(a.grad) == 100.0
