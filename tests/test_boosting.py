"""XGBLoRA boosting: equivalence to plain LoRA, merge invariants, layer sampling, adaptive merge, exact resume."""

import copy
import io
import logging
import math

import pytest
import torch
from conftest import forget_state_in
from torch import nn

from xgblora.adapters.boosting import Boosting, block_of
from xgblora.adapters.lora import LoRALinear, attach, unwrap
from xgblora.models import pretrained


def _batch(model, step: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1000 + step))


def _setup(seed: int = 0, r: int = 1, **boost):
    torch.manual_seed(seed)
    model, _ = pretrained.load("tiny-opt")
    model.eval()  # no dropout: runs are comparable
    report = attach(model, r=r, alpha=16.0)
    boosting = None
    if boost:
        boosting = Boosting(report.modules, seed=seed, **boost)
        boosting.begin()
    params = [p for n, p in model.named_parameters() if ".lora_" in n]
    return model, report.modules, boosting, torch.optim.AdamW(params, lr=1e-2)


def _train(model, opt, boosting, first: int, last: int) -> tuple[list[float], list[dict]]:
    """Steps first..last (1-based): forward, backward, AdamW step, then the boosting hook."""
    losses, events = [], []
    for step in range(first, last + 1):
        ids = _batch(model, step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if boosting is not None and (event := boosting.after_step(step, loss.item(), forget_state_in(opt))) is not None:
            events.append(event)
    return losses, events


def _fake_modules(blocks: int, seed: int = 0) -> dict[str, LoRALinear]:
    torch.manual_seed(seed)
    return {f"model.layers.{i}.attn.{p}": LoRALinear(nn.Linear(8, 8), 1, 2.0) for i in range(blocks) for p in "qv"}


def test_block_of():
    assert block_of("model.decoder.layers.3.self_attn.q_proj") == "model.decoder.layers.3"
    assert block_of("model.layers.12.mlp.up_proj") == "model.layers.12"
    assert block_of("lm_head") == "lm_head"


@pytest.mark.parametrize("steps_per_iteration", [11, 1000])
def test_single_iteration_is_plain_rank1_lora(steps_per_iteration):
    model_a, mods_a, _, opt_a = _setup()
    model_b, mods_b, boosting, opt_b = _setup(steps_per_iteration=steps_per_iteration)
    losses_a, _ = _train(model_a, opt_a, None, 1, 10)
    losses_b, events = _train(model_b, opt_b, boosting, 1, 10)
    assert events == [] and boosting.history == []
    assert losses_a == losses_b
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_merge_at_the_last_step_changes_no_loss():
    model_a, _, _, opt_a = _setup()
    model_b, _, boosting, opt_b = _setup(steps_per_iteration=10)
    losses_a, _ = _train(model_a, opt_a, None, 1, 10)
    losses_b, events = _train(model_b, opt_b, boosting, 1, 10)
    assert losses_a == losses_b and [e["step"] for e in events] == [10]


def test_merge_invariants(caplog):
    model, mods, boosting, opt = _setup(steps_per_iteration=3, shrinkage=0.5)
    _train(model, opt, None, 1, 3)  # three steps without the hook, then the due merge by hand
    ids = _batch(model, 99)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    old = {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone(), m.base.weight.detach().clone())
           for n, m in mods.items()}
    assert all(m.lora_A in opt.state for m in mods.values())
    with caplog.at_level(logging.INFO, logger="xgblora"):
        event = boosting.after_step(3, 1.0, forget_state_in(opt))
    assert event == {"event": "merge", "booster": 1, "step": 3, "modules": len(mods)}
    assert "XGBLoRA: merged booster 1 at step 3" in caplog.text
    assert len(boosting.history) == 1 and boosting.history[0]["step"] == 3
    for n, m in mods.items():
        A0, B0, W0 = old[n]
        rec = boosting.history[0]["modules"][n]
        assert torch.equal(rec["A"], A0) and torch.equal(rec["B"], B0) and rec["scale"] == 0.5 * 16.0
        assert B0.abs().max() > 0
        torch.testing.assert_close(m.base.weight.detach(), W0 + 0.5 * 16.0 * B0 @ A0)
        assert not torch.equal(m.lora_A.detach(), A0)
        assert m.lora_A.abs().max() <= 1 / 64 ** 0.5 and m.lora_A.abs().max() > 0
        assert torch.count_nonzero(m.lora_B) == 0
        assert m.lora_A not in opt.state and m.lora_B not in opt.state
        assert m.lora_A.grad is None and m.lora_B.grad is None
    with torch.no_grad():
        after = model(input_ids=ids).logits
    # shrinkage 0.5 merges half the booster: the model now lacks the other half ...
    assert (after - before).abs().max() > 1e-4
    # ... while with shrinkage 1 the logits are unchanged across the merge.
    model, mods, boosting, opt = _setup(steps_per_iteration=3)
    _train(model, opt, None, 1, 3)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        boosting.after_step(3, None, forget_state_in(opt))
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=2e-5)
    # training continues: the optimizer rebuilds the state of the fresh booster
    losses, _ = _train(model, opt, boosting, 4, 5)
    assert all(m.lora_A in opt.state for m in mods.values()) and all(map(lambda x: x == x, losses))


def test_a_booster_started_from_the_gradient_after_a_merge():
    """After a merge, init_from_gradients gives each layer of the new subset A = the leading right singular
    vector of autograd's gradient of its merged weight (reduced over ranks), B = 0: the logits do not move and
    the layers outside the subset keep their factors."""
    model, mods, boosting, opt = _setup(steps_per_iteration=3, layers_per_booster=1)
    _train(model, opt, boosting, 1, 3)  # merged at step 3; a new block carries the next booster
    active = boosting.active_modules()
    assert 0 < len(active) < len(mods)
    idle = {n: m.lora_A.detach().clone() for n, m in mods.items() if n not in active}
    ids = _batch(model, 77)
    reference = copy.deepcopy(model)
    unwrap(reference)  # B = 0: the merged weights alone
    for name in active:
        reference.get_submodule(name).weight.requires_grad_(True)
    reference(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    reduced = []

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        reduced.append(grad)
        return grad

    boosting.init_from_gradients(lambda inputs: model(input_ids=ids, labels=ids).loss.backward(inputs=inputs), reduce)
    assert len(reduced) == len(active)
    for name, m in active.items():
        v = torch.linalg.svd(reference.get_submodule(name).weight.grad)[2][0]
        torch.testing.assert_close(float((m.lora_A.detach()[0] @ v).abs()), 1 / math.sqrt(3), atol=1e-5, rtol=0)
        assert torch.count_nonzero(m.lora_B) == 0 and m.lora_A.grad is None and m.lora_B.grad is None
    assert all(torch.equal(mods[n].lora_A, a) for n, a in idle.items())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_an_orthogonal_gradient_start_avoids_every_earlier_boosters_directions():
    """orthogonal=True: after two merges each layer's new A is the leading right singular vector of autograd's
    gradient with the A rows of that layer's merged boosters (from the history) projected off, so it is orthogonal
    to each of them; B = 0 keeps the logits."""
    model, mods, boosting, opt = _setup(steps_per_iteration=3)
    _train(model, opt, boosting, 1, 6)  # two boosters merged on every layer
    ids = _batch(model, 78)
    reference = copy.deepcopy(model)
    unwrap(reference)
    for name in mods:
        reference.get_submodule(name).weight.requires_grad_(True)
    reference(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    boosting.init_from_gradients(lambda inputs: model(input_ids=ids, labels=ids).loss.backward(inputs=inputs),
                                 orthogonal=True)
    for name, m in mods.items():
        earlier = torch.cat([h["modules"][name]["A"] for h in boosting.history])
        assert earlier.shape[0] == 2
        q = torch.linalg.qr(earlier.T)[0]  # (in, 2)
        grad = reference.get_submodule(name).weight.grad
        v = torch.linalg.svd(grad - grad @ q @ q.T)[2][0]
        torch.testing.assert_close(float((m.lora_A.detach()[0] @ v).abs()), 1 / math.sqrt(3), atol=1e-5, rtol=0)
        torch.testing.assert_close(m.lora_A.detach() @ earlier.T, torch.zeros(1, 2), atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_fixed_schedule_with_several_merges():
    model, mods, boosting, opt = _setup(steps_per_iteration=3, layers_per_booster=1)
    losses, events = _train(model, opt, boosting, 1, 10)
    assert [(e["booster"], e["step"], e["modules"]) for e in events] == [(1, 3, 2), (2, 6, 2), (3, 9, 2)]
    for h in boosting.history:  # each booster lives on one block: its q and v projections
        assert len({block_of(n) for n in h["modules"]}) == 1 and len(h["modules"]) == 2
    assert len(losses) == 10


def test_layer_sampling_frequency_and_activity():
    mods = _fake_modules(12)
    boosting = Boosting(mods, steps_per_iteration=1, layers_per_booster=3, seed=5)
    boosting.begin()
    iterations, counts = 600, torch.zeros(12)
    for step in range(1, iterations + 1):
        active = {n for n, m in mods.items() if m.active}
        chosen = {int(n.split(".")[2]) for n in active}
        assert len(chosen) == 3 and chosen == set(boosting.subset)
        assert active == {f"model.layers.{i}.attn.{p}" for i in chosen for p in "qv"}
        for m in mods.values():
            assert m.lora_A.requires_grad == m.active == m.lora_B.requires_grad
        counts[list(chosen)] += 1
        boosting.after_step(step, None)
    freq = counts / iterations
    bound = 5 * (0.25 * 0.75 / iterations) ** 0.5
    assert (freq - 0.25).abs().max() < bound
    assert all(len(h["modules"]) == 6 for h in boosting.history)


def test_inactive_modules_get_no_gradient_and_no_effect():
    model, mods, boosting, opt = _setup(steps_per_iteration=5, layers_per_booster=1)
    inactive = [m for m in mods.values() if not m.active]
    active = [m for m in mods.values() if m.active]
    assert len(inactive) == 2 and len(active) == 2
    ids = _batch(model, 0)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for m in inactive:
            m.lora_B.normal_()
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(m.lora_A.grad is None and m.lora_B.grad is None for m in inactive)
    assert all(m.lora_A.grad is not None and m.lora_B.grad is not None for m in active)


def test_norm_penalty():
    mods = _fake_modules(4)
    for m in mods.values():
        with torch.no_grad():
            m.lora_B.normal_()
    boosting = Boosting(mods, steps_per_iteration=10, layers_per_booster=2, seed=1)
    boosting.begin()
    penalty = boosting.norm_penalty(0.1)
    ref = 0.1 * sum(float((m.lora_A.detach() ** 2).sum() + (m.lora_B.detach() ** 2).sum()) for m in mods.values() if m.active)
    assert penalty.dim() == 0 and penalty.item() == pytest.approx(ref, rel=1e-6)
    penalty.backward()
    for m in mods.values():
        if m.active:
            torch.testing.assert_close(m.lora_A.grad, 0.2 * m.lora_A.detach())
        else:
            assert m.lora_A.grad is None


def test_adaptive_merge_after_plateau_rolls_back_to_best():
    mods = _fake_modules(2)
    boosting = Boosting(mods, steps_per_iteration=10_000, adaptive=True, patience=4, threshold=1e-3, ema=0.0)
    boosting.begin()
    losses = [1.0, 0.9, 0.8, 0.7, 0.6, 0.6, 0.6005, 0.5999, 0.6, 0.6]
    gen = torch.Generator().manual_seed(0)
    best, merged_at = None, None
    for step, loss in enumerate(losses, start=1):
        with torch.no_grad():  # stands in for an optimizer step
            for m in mods.values():
                m.lora_A.add_(torch.randn(m.lora_A.shape, generator=gen))
                m.lora_B.add_(torch.randn(m.lora_B.shape, generator=gen))
        if step == 5:  # the last step that improves on the best by more than 0.1 %
            best = {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone(), m.base.weight.detach().clone())
                    for n, m in mods.items()}
        event = boosting.after_step(step, loss)
        if event is not None:
            merged_at = step
            break
    assert merged_at == 9  # 5 + patience
    rec = boosting.history[0]["modules"]
    for n, m in mods.items():
        A, B, W = best[n]
        assert torch.equal(rec[n]["A"], A) and torch.equal(rec[n]["B"], B)
        torch.testing.assert_close(m.base.weight.detach(), W + 2.0 * B @ A)
        assert torch.count_nonzero(m.lora_B) == 0


def test_adaptive_does_not_merge_while_improving():
    boosting = Boosting(_fake_modules(1), steps_per_iteration=1000, adaptive=True, patience=3, ema=0.9)
    boosting.begin()
    assert all(boosting.after_step(s, 2.0 * 0.97 ** s) is None for s in range(1, 200))
    assert boosting.after_step(200, None) is None


@pytest.mark.parametrize("cap", [None, 30])
def test_adaptive_merge_is_capped_at_a_boosters_steps(cap):
    boosting = Boosting(_fake_modules(1), steps_per_iteration=50, adaptive=True, max_booster_steps=cap, patience=3)
    boosting.begin()
    merges = [s for s in range(1, 121) if boosting.after_step(s, 2.0 * 0.97 ** s) is not None]  # always improving
    every = cap or 50
    assert merges == list(range(every, 121, every))


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("adaptive", [False, True])
def test_state_dict_roundtrip_resumes_exactly(adaptive):
    kwargs = dict(steps_per_iteration=2, layers_per_booster=1, adaptive=adaptive, patience=2, threshold=0.05, ema=0.5)
    model, mods, boosting, opt = _setup(**kwargs)
    _, first_events = _train(model, opt, boosting, 1, 5)
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "boosting": boosting.state_dict()})
    losses, events = _train(model, opt, boosting, 6, 14)
    assert first_events and events  # merges happen before and after the checkpoint

    model2, mods2, boosting2, opt2 = _setup(**kwargs)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    boosting2.load_state_dict(saved["boosting"])
    losses2, events2 = _train(model2, opt2, boosting2, 6, 14)
    assert losses == losses2 and events == events2
    assert [m.active for m in mods.values()] == [m.active for m in mods2.values()]
    state, state2 = model.state_dict(), model2.state_dict()
    assert all(torch.equal(state[k], state2[k]) for k in state)
    assert len(boosting.history) == len(boosting2.history)
    for h, h2 in zip(boosting.history, boosting2.history, strict=True):
        assert h["step"] == h2["step"] and h["modules"].keys() == h2["modules"].keys()
        assert all(torch.equal(h["modules"][n]["A"], h2["modules"][n]["A"]) for n in h["modules"])
