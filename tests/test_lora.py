"""LoRALinear against hand-computed references; merge invariance on tiny models; dual-batch mode; attach/unwrap."""

import copy
import math
import types

import pytest
import torch
from torch import nn

from xgblora.adapters.lora import (
    LoRALinear,
    MemberRows,
    attach,
    default_targets,
    lora_modules,
    lora_scaling,
    prepare_full_ft,
    unwrap,
)
from xgblora.adapters.peft import to_peft
from xgblora.errors import UserError
from xgblora.models import pretrained


def _layer(in_f: int = 16, out_f: int = 12, r: int = 4, alpha: float = 8.0, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    layer = LoRALinear(nn.Linear(in_f, out_f).to(dtype), r, alpha)
    with torch.no_grad():
        layer.lora_B.normal_()
    return layer


def _train_adapters(model, steps: int = 4, lr: float = 5e-2, seed: int = 0) -> None:
    """A few AdamW steps on random tokens so that every B is non-zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def test_forward_and_gradients_match_reference():
    layer = _layer()
    x = torch.randn(3, 5, 16, requires_grad=True)
    out = layer(x)
    W, b = layer.base.weight.detach(), layer.base.bias.detach()
    A = layer.lora_A.detach().clone().requires_grad_(True)
    B = layer.lora_B.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = x_ref @ W.T + b + (8.0 / 4) * x_ref @ A.T @ B.T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(layer.lora_A.grad, A.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_B.grad, B.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert layer.base.weight.grad is None and not layer.base.weight.requires_grad
    torch.testing.assert_close(layer.delta_weight(), 2.0 * B.detach() @ A.detach())


def test_fp32_adapters_on_bf16_base():
    layer = _layer(dtype=torch.bfloat16)
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    base = layer.base(x).float()
    ref = base + 2.0 * x.float() @ layer.lora_A.detach().T @ layer.lora_B.detach().T
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    out.float().sum().backward()
    assert layer.lora_A.grad.dtype == torch.float32 and layer.lora_B.grad.dtype == torch.float32
    # A tiny update to A survives in fp32 (it would round away in bf16).
    before = layer.lora_A.detach().clone()
    with torch.no_grad():
        layer.lora_A.add_(1e-6)
    assert not torch.equal(before, layer.lora_A.detach())


def test_bf16_training_forward_keeps_no_fp32_copy_of_the_input_and_grads_match_fp32():
    layer = _layer(in_f=64, out_f=48, dtype=torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    input_sized = [t for t in saved if t.numel() == x.numel()]
    assert input_sized and all(t.dtype == torch.bfloat16 for t in input_sized)  # x itself, not an fp32 copy
    A = layer.lora_A.detach().clone().requires_grad_(True)
    B = layer.lora_B.detach().clone().requires_grad_(True)
    ref = layer.base(x).float() + 2.0 * x.float() @ A.T @ B.T
    g = torch.randn_like(ref)
    out.float().backward(g)
    ref.backward(g)
    assert layer.lora_A.grad.dtype == layer.lora_B.grad.dtype == torch.float32
    for got, want in ((layer.lora_A.grad, A.grad), (layer.lora_B.grad, B.grad)):
        assert (got - want).norm() < 2e-2 * want.norm()  # bf16 rounding of the branch only


def test_without_a_graph_a_bf16_base_sums_the_branch_in_fp32_and_rounds_once():
    layer = _layer(in_f=64, out_f=48, dtype=torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():  # MeZO's forwards and evaluation: an eps-sized change of A or B is not rounded away
        out = layer(x)
        exact = (layer.base(x).float() + (x.float() @ layer.lora_A.T * 2.0) @ layer.lora_B.T).to(torch.bfloat16)
        layer.lora_A.add_(1e-3 * torch.randn_like(layer.lora_A))
        moved = layer(x)
    torch.testing.assert_close(out, exact, rtol=0, atol=0)
    assert not torch.equal(out, moved)


def test_inactive_is_the_base_alone():
    layer = _layer()
    x = torch.randn(2, 16)
    layer.active = False
    assert torch.equal(layer(x), layer.base(x))


def test_reset_is_kaiming_uniform_and_seeded():
    layer = _layer(in_f=40, r=3)
    layer.reset(torch.Generator().manual_seed(7))
    ref = torch.empty(3, 40)
    nn.init.kaiming_uniform_(ref, a=math.sqrt(5), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(layer.lora_A.detach(), ref, rtol=1e-6, atol=1e-7)
    assert torch.count_nonzero(layer.lora_B) == 0
    other = layer.lora_A.detach().clone()
    layer.reset(torch.Generator().manual_seed(8))
    assert not torch.equal(other, layer.lora_A.detach())


def test_merge_of_a_single_layer():
    layer = _layer()
    x = torch.randn(6, 16)
    before = layer(x)
    expected_w = layer.base.weight.detach() + 0.5 * 2.0 * layer.lora_B.detach() @ layer.lora_A.detach()
    layer.merge(0.5)
    torch.testing.assert_close(layer.base.weight.detach(), expected_w)
    with torch.no_grad():
        layer.lora_B.mul_(0.5)
    torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_merge_keeps_logits_fp32(name):
    model, _ = pretrained.load(name)
    attach(model, r=4, alpha=8.0)
    _train_adapters(model)
    assert all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for m in lora_modules(model).values():
            m.merge()
            m.reset()
        after_merge = model(input_ids=ids).logits
        unwrap(model)
        after_unwrap = model(input_ids=ids).logits
    assert not lora_modules(model)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith(("q_proj", "v_proj")))
    torch.testing.assert_close(after_merge, before, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(after_unwrap, before, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_merge_keeps_logits_bf16(name):
    model, _ = pretrained.load(name, dtype="bfloat16")
    plain = copy.deepcopy(model)
    attach(model, r=4, alpha=8.0)
    _train_adapters(model, lr=1e-1)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    plain.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits.float()
        base_only = plain(input_ids=ids).logits.float()
        unwrap(model)
        after = model(input_ids=ids).logits.float()
    adapter_effect = (before - base_only).abs().max()
    merge_error = (after - before).abs().max()
    scale = before.abs().max()
    assert adapter_effect > 0.05 * scale  # the adapters matter ...
    assert merge_error < 0.02 * scale  # ... and merging them changes the logits by bf16 rounding only
    assert merge_error < 0.2 * adapter_effect


def _perturbed(layer: LoRALinear, z_A: torch.Tensor, z_B: torch.Tensor, scale: float) -> LoRALinear:
    """A copy of layer with its factors moved in place by scale z, as MeZO's two-pass forwards perturb them."""
    other = copy.deepcopy(layer)
    other.clear_members()
    with torch.no_grad():
        other.lora_A.add_(scale * z_A)
        other.lora_B.add_(scale * z_B)
    return other


def test_member_mode_runs_each_run_of_rows_on_its_members_factors():
    """MeZO's dual batch: rows [:3] on theta + eps z, rows [3:] on theta - eps z; equal to perturbing in place."""
    layer = _layer()
    x = torch.randn(6, 5, 16)
    z_A, z_B = torch.randn_like(layer.lora_A), torch.randn_like(layer.lora_B)
    eps = 1e-2
    A, B = layer.lora_A.detach(), layer.lora_B.detach()
    layer.set_members(torch.stack([A + eps * z_A, A - eps * z_A]), torch.stack([B + eps * z_B, B - eps * z_B]))
    with torch.no_grad():
        dual = layer(x)
    layer.clear_members()
    for half, sign in ((slice(0, 3), 1.0), (slice(3, 6), -1.0)):
        with torch.no_grad():
            torch.testing.assert_close(dual[half], _perturbed(layer, z_A, z_B, sign * eps)(x[half]),
                                       rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _perturbed(layer, z_A, z_B, 0.0)(x))  # member mode left
    with pytest.raises(ValueError):
        layer.set_members(torch.stack([A, A]), torch.stack([B, B]))
        layer(torch.randn(3, 16))
    with pytest.raises(ValueError, match="do not stack"):
        layer.set_members(A[None], B)


def test_member_mode_follows_a_member_index_per_row():
    """Rows in any order, regrouped between forwards: each row's output is its member's layer's, whoever is beside."""
    layer = _layer()
    eps, members = 5e-2, 3
    zs = [(torch.randn_like(layer.lora_A), torch.randn_like(layer.lora_B)) for _ in range(members)]
    A, B = layer.lora_A.detach(), layer.lora_B.detach()
    rows = MemberRows()
    layer.set_members(torch.stack([A + eps * z_A for z_A, _ in zs]), torch.stack([B + eps * z_B for _, z_B in zs]),
                      rows)
    x = torch.randn(5, 4, 16)
    for index in ([2, 0, 1, 1, 2], [0, 0, 2, 1, 0]):
        rows.index = torch.tensor(index)
        with torch.no_grad():
            out = layer(x)
            for i, k in enumerate(index):
                torch.testing.assert_close(out[i], _perturbed(layer, *zs[k], eps)(x[i]), rtol=1e-6, atol=1e-6)
    rows.index = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="2 rows' members for a batch of 5"):
        layer(x)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_dual_perturbation_whole_model(name):
    model, _ = pretrained.load(name)
    attach(model, r=2, alpha=4.0)
    _train_adapters(model, steps=2)
    mods = lora_modules(model)
    gen = torch.Generator().manual_seed(3)
    z = {n: (torch.randn(m.lora_A.shape, generator=gen), torch.randn(m.lora_B.shape, generator=gen))
         for n, m in mods.items()}
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=gen)
    eps = 1e-2
    model.eval()
    with torch.no_grad():
        for n, m in mods.items():
            A, B, (z_A, z_B) = m.lora_A, m.lora_B, z[n]
            m.set_members(torch.stack([A + eps * z_A, A - eps * z_A]), torch.stack([B + eps * z_B, B - eps * z_B]))
        dual = model(input_ids=torch.cat([ids, ids])).logits
        for m in mods.values():
            m.clear_members()
        halves = []
        for sign in (1.0, -1.0):
            other = copy.deepcopy(model)
            for n, m in lora_modules(other).items():
                m.lora_A.add_(sign * eps * z[n][0])
                m.lora_B.add_(sign * eps * z[n][1])
            halves.append(other(input_ids=ids).logits)
    torch.testing.assert_close(dual[:3], halves[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dual[3:], halves[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(halves[0], halves[1], atol=1e-4)


def test_attach_on_opt_350m_shape():
    model, _ = pretrained.random_model("opt-350m-random", hidden_size=64, ffn_dim=128, num_attention_heads=4,
                                   word_embed_proj_dim=64, vocab_size=512)
    total_before = sum(p.numel() for p in model.parameters())
    report = attach(model, r=8, alpha=16.0)
    assert len(report.modules) == 48
    assert set(report.modules) == {f"model.decoder.layers.{i}.self_attn.{p}" for i in range(24) for p in ("q_proj", "v_proj")}
    assert report.trainable_params == 48 * 8 * (64 + 64)
    assert report.total_params == total_before + report.trainable_params
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.lora_{x}" for m in report.modules for x in "AB"}
    assert str(report) == (f"LoRA r=8: 48 modules (q_proj, v_proj), 49,152 trainable parameters "
                           f"({100 * 49152 / report.total_params:.2f}% of {report.total_params:,})")
    assert lora_modules(model) == report.modules


def test_attach_errors():
    model, _ = pretrained.load("tiny-opt")
    with pytest.raises(UserError, match=r"nope.*fc1"):
        attach(model, ["nope"])
    attach(model, ["fc1"], r=2)
    with pytest.raises(UserError, match="already"):
        attach(model)


def test_default_targets():
    def fake(model_type):
        return types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type), named_modules=lambda: [])
    assert default_targets(fake("opt")) == ["q_proj", "v_proj"]
    assert default_targets(fake("llama")) == ["q_proj", "v_proj"]
    assert default_targets(fake("qwen2")) == ["q_proj", "v_proj"]
    assert default_targets(fake("bert")) == ["query", "value"]
    assert default_targets(fake("roberta")) == ["query", "value"]
    assert default_targets(fake("gpt2")) == ["c_attn"]
    with pytest.raises(UserError, match="lora_target_modules"):
        default_targets(fake("mystery"))


def _peft_targets(model: nn.Module, target_modules) -> set[str]:
    """The module names PEFT itself adapts for target_modules (its own matcher, on a copy of the model)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=target_modules))
    return {name.removeprefix("base_model.model.") for name, m in peft_model.named_modules()
            if hasattr(m, "lora_A") and isinstance(m.lora_A, nn.ModuleDict)}


def test_all_linear_adapts_the_seven_projections_of_every_llama_block_as_peft_does():
    model, _ = pretrained.load("tiny-llama")
    report = attach(copy.deepcopy(model), "all-linear", r=2)
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert set(report.modules) == {f"model.layers.{i}.{p}" for i in range(2) for p in projections}
    assert set(report.modules) == _peft_targets(model, "all-linear")


@pytest.mark.parametrize("spec", [r".*\.(q_proj|o_proj)", "q_proj,mlp.up_proj", ["k_proj", "down_proj"]])
def test_regex_and_suffix_targets_select_what_peft_selects(spec):
    model, _ = pretrained.load("tiny-llama")
    peft_spec = spec.split(",") if isinstance(spec, str) and "," in spec else spec
    assert set(attach(copy.deepcopy(model), spec, r=2).modules) == _peft_targets(model, peft_spec)


def test_a_bad_regex_is_a_user_error():
    model, _ = pretrained.load("tiny-llama")
    with pytest.raises(UserError, match=r"not a valid regular expression"):
        attach(model, ".*(q_proj")


def test_gpt2_conv1d_adapter_matches_peft_exports_and_merges_in_its_layout(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)).eval()
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                                 fan_in_fan_out=True))
    base = copy.deepcopy(model)
    report = attach(model, r=4, alpha=8.0)  # gpt2's default target: c_attn, a Conv1D
    assert set(report.modules) == {f"transformer.h.{i}.attn.c_attn" for i in range(2)}
    for name, module in report.modules.items():
        assert module.fan_in_fan_out and (module.in_features, module.out_features) == (32, 96)
        torch.nn.init.normal_(module.lora_B)
        peft_layer = peft_model.get_submodule(f"base_model.model.{name}")
        peft_layer.lora_A["default"].weight.data.copy_(module.lora_A)
        peft_layer.lora_B["default"].weight.data.copy_(module.lora_B)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        ours, theirs = model(ids).logits, peft_model(ids).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        to_peft(report.modules, [], tmp_path / "adapter", "gpt2-tiny")
        exported = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(exported(ids).logits, theirs, rtol=1e-5, atol=1e-5)
        unwrap(model)  # merged into the (in, out) Conv1D weight
        torch.testing.assert_close(model(ids).logits, theirs, rtol=1e-5, atol=1e-5)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)).eval()


def _lm_loss(model, seed: int) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def _autograd_weight_grads(model, names: list[str], seeds: list[int]) -> dict[str, torch.Tensor]:
    """The reference: the adapters merged into plain weights, autograd's gradient of each named weight summed
    over the batches, (out, in) (a Conv1D's transposed)."""
    merged = copy.deepcopy(model)
    unwrap(merged)
    layers = {name: merged.get_submodule(name) for name in names}
    for layer in layers.values():
        layer.weight.requires_grad_(True)
    for seed in seeds:
        _lm_loss(merged, seed).backward()
    return {name: (layer.weight.grad.T if type(layer).__name__ == "Conv1D" else layer.weight.grad)
            for name, layer in layers.items()}


@pytest.mark.parametrize("arch", ["opt", "gpt2-conv1d"])
def test_weight_grad_is_autograds_gradient_of_the_effective_weight(arch):
    model = pretrained.load("tiny-opt")[0].eval() if arch == "opt" else _gpt2()
    modules = attach(model, r=2, alpha=4.0).modules
    for m in modules.values():  # the branch is part of the weight whose gradient is taken
        nn.init.normal_(m.lora_B, std=0.1)
    expected = _autograd_weight_grads(model, list(modules), seeds=[1, 2])
    for m in modules.values():
        m.start_weight_grad()
    for seed in (1, 2):
        _lm_loss(model, seed).backward(inputs=[m.lora_B for m in modules.values()])
    for name, m in modules.items():
        got = m.take_weight_grad()
        assert got.shape == (m.out_features, m.in_features)
        torch.testing.assert_close(got, expected[name], rtol=1e-4, atol=1e-6)
    _lm_loss(model, 3).backward()  # accumulation stopped: no hook left behind
    assert all(m._weight_grad is None for m in modules.values())


@pytest.mark.parametrize("r", [1, 2])
def test_init_from_gradient_starts_on_the_gradients_leading_singular_directions(r):
    """A = the leading right singular vectors of autograd's gradient G (at reset()'s row norm 1/sqrt(3)), B = 0:
    the output is the base model's, and the first gradient of B is scaling G A^T = scaling U_r S_r / sqrt(3)."""
    model = pretrained.load("tiny-opt")[0].eval()
    base = copy.deepcopy(model)
    modules = attach(model, r=r, alpha=2.0 * r).modules
    grads = _autograd_weight_grads(model, list(modules), seeds=[4])
    for name, m in modules.items():
        m.init_from_gradient(grads[name])
        u, s, vh = torch.linalg.svd(grads[name])
        assert torch.equal(m.lora_B, torch.zeros_like(m.lora_B))
        torch.testing.assert_close((m.lora_A @ vh[:r].T).abs(), torch.eye(r) / math.sqrt(3), atol=1e-5, rtol=0)
    with torch.no_grad():
        ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
    _lm_loss(model, 4).backward()
    for name, m in modules.items():
        u, s, vh = torch.linalg.svd(grads[name])
        torch.testing.assert_close(m.lora_B.grad, m.scaling * grads[name] @ m.lora_A.detach().T, rtol=1e-4,
                                   atol=1e-7)
        torch.testing.assert_close(m.lora_B.grad.abs(), m.scaling * (u[:, :r] * s[:r]).abs() / math.sqrt(3),
                                   rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("r", [1, 2])
def test_init_from_gradient_off_taken_directions(r):
    """With taken directions (orthonormal rows Q), A = the leading right singular vectors of G (I - Q^T Q),
    computed here from autograd's G: orthogonal to every taken row, at reset()'s row norm; B = 0. Once fewer than
    r directions would be left, the full gradient's."""
    model = pretrained.load("tiny-opt")[0].eval()
    modules = attach(model, r=r, alpha=2.0 * r).modules
    grads = _autograd_weight_grads(model, list(modules), seeds=[5])
    for name, m in modules.items():
        taken = torch.linalg.qr(torch.randn(m.in_features, 3, generator=torch.Generator().manual_seed(1)))[0].T
        m.init_from_gradient(grads[name], taken)
        vh = torch.linalg.svd(grads[name] - grads[name] @ taken.T @ taken)[2]
        torch.testing.assert_close((m.lora_A @ vh[:r].T).abs(), torch.eye(r) / math.sqrt(3), atol=1e-5, rtol=0)
        torch.testing.assert_close(m.lora_A @ taken.T, torch.zeros(r, 3), atol=1e-6, rtol=0)
        assert torch.count_nonzero(m.lora_B) == 0
        full = torch.linalg.qr(torch.randn(m.in_features, m.in_features - r + 1))[0].T
        m.init_from_gradient(grads[name], full)
        vh = torch.linalg.svd(grads[name])[2]
        torch.testing.assert_close((m.lora_A @ vh[:r].T).abs(), torch.eye(r) / math.sqrt(3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("r", [1, 2])
def test_init_from_gradient_inside_the_taken_span_falls_back_to_the_plain_start(r):
    """A gradient whose rows lie in the taken span has nothing outside it but rounding noise: A is then the
    plain gradient start (the leading right singular vectors of G), not a noise direction."""
    m = LoRALinear(nn.Linear(16, 8, bias=False), r=r, alpha=2.0 * r)
    taken = torch.linalg.qr(torch.randn(16, 4, generator=torch.Generator().manual_seed(2)))[0].T
    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(3)) @ taken
    m.init_from_gradient(grad, taken)
    vh = torch.linalg.svd(grad.double())[2].float()
    torch.testing.assert_close((m.lora_A @ vh[:r].T).abs(), torch.eye(r) / math.sqrt(3), atol=1e-5, rtol=0)


def test_prepare_full_ft():
    model, _ = pretrained.load("tiny-opt")
    for p in model.parameters():
        p.requires_grad_(False)
    count = prepare_full_ft(model)
    assert count == sum(p.numel() for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


# ----------------------------------------------------------------------------- rank-aware scaling

def test_default_alpha_keeps_alpha_over_r_at_mezos_two_for_every_rank():
    from xgblora.config import Config

    def scaling(cfg: Config) -> float:
        return lora_scaling(cfg.alpha, cfg.rank, cfg.use_rslora)

    for method, r, alpha in (("lora", None, 16.0), ("xgblora", None, 2.0), ("lora", 1, 2.0), ("lora", 32, 64.0)):
        cfg = Config(method=method, lora_r=r)
        assert (cfg.alpha, scaling(cfg)) == (alpha, 2.0)
    assert scaling(Config(method="xgblora", lora_alpha=16.0)) == 16.0  # an explicit alpha wins
    assert scaling(Config(method="lora", lora_alpha=16.0)) == 2.0  # MeZO's r=8, alpha=16 unchanged
    assert scaling(Config(method="lora", use_rslora=True)) == pytest.approx(2.0)  # the same at r=8
    assert scaling(Config(method="xgblora", use_rslora=True)) == pytest.approx(2 * math.sqrt(8))
    assert scaling(Config(method="lora", lora_r=4, lora_alpha=6.0, use_rslora=True)) == 3.0


def test_rslora_branch_is_alpha_over_sqrt_r():
    base = nn.Linear(16, 12)
    layer = LoRALinear(base, r=4, alpha=6.0, rslora=True)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 16)
    expected = base(x) + (6.0 / 2.0) * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(layer(x), expected)


def test_zo_with_a_large_adapter_scale_warns(caplog):
    from xgblora.config import Config
    from xgblora.train.setup import setup_method

    def set_up(**options) -> None:
        setup_method(pretrained.load("tiny-opt")[0], Config(model_name="tiny-opt", **options))

    with caplog.at_level("WARNING", logger="xgblora"):
        set_up(trainer="zo", method="xgblora")
        set_up(trainer="zo", method="lora", lora_alpha=16.0)
        set_up(trainer="regular", method="xgblora", lora_alpha=16.0)
    assert not [r for r in caplog.records if "adapter scale" in r.getMessage()]
    with caplog.at_level("WARNING", logger="xgblora"):
        set_up(trainer="zo", method="xgblora", lora_alpha=16.0)
    assert "adapter scale of 16" in caplog.text and "64x that of r=8" in caplog.text


def test_a_plain_rslora_adapter_exports_with_its_scale(tmp_path):
    from xgblora.adapters.peft import read_adapter, to_peft

    model, _ = pretrained.load("tiny-opt")
    report = attach(model, None, r=4, alpha=6.0, rslora=True)
    for m in report.modules.values():
        nn.init.normal_(m.lora_B)
    to_peft(report.modules, [], tmp_path, "tiny-opt")
    adapter, _ = read_adapter(tmp_path)
    for name, m in report.modules.items():
        A, B, scaling = adapter[name]
        torch.testing.assert_close(B @ A * scaling, m.delta_weight())
