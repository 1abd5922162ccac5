"""The CUDA paths, each against its CPU/eager/unfused counterpart: bf16 autocast, attention selection (SDPA,
flash-attention), varlen packing, fused AdamW, --compile, MeZO's dual batch, full-model MeZO in bf16 (z in pieces,
little memory added), activation offloading (the same step, a lower peak), Liger's kernels (the same loss and gradients), out-of-memory halving on a real OOM,
and a 1-GPU NCCL process group, the padded loss without a host sync. Marked `cuda`; without a GPU every test skips with the reason.
`xgblora bench --suite gpu --cuda_tests tests/test_cuda.py` runs them (`python -m pytest -m cuda tests/test_cuda.py`)."""

import importlib.util
import os
import tempfile
import types

import pytest
import torch

from xgblora.adapters import lora
from xgblora.bench.workloads import synthetic_seqs
from xgblora.config import Config
from xgblora.data.collation import collate, collate_packed
from xgblora.distributed import Distributed
from xgblora.models import pretrained
from xgblora.models.scoring import packing_supported
from xgblora.optim.fo import AdamWStepper, build_optimizer
from xgblora.optim.zo import MeZO
from xgblora.train.objective import TrainingLoss, per_example_loss
from xgblora.train.setup import autocast_dtype

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU (xgblora bench --suite gpu runs these)")]
CUDA = torch.device("cuda")


def _lora_model(name: str = "tiny-llama", dtype: str = "float32", attn: str = "auto") -> tuple[torch.nn.Module, dict]:
    model, _ = pretrained.load(name, dtype=dtype, device="cuda", attn_implementation=attn)
    report = lora.attach(model, ["q_proj", "v_proj"], r=8, alpha=16.0)
    with torch.no_grad():  # B = 0 at init: give the adapters an effect to compare
        gen = torch.Generator("cuda").manual_seed(0)
        for _, p in _adapters(model):
            p.normal_(0, 0.05, generator=gen)
    return model, report.modules


def _batch(model: torch.nn.Module, rows: int = 4, length: int = 48, seed: int = 0):
    seqs = synthetic_seqs(rows, length, length // 4, int(model.config.vocab_size), seed=seed)
    return seqs, collate(seqs, model.config.pad_token_id or 0).to(CUDA)


def _adapters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if lora.is_adapter_param(n)]


def test_bf16_autocast_is_the_cuda_default_and_close_to_fp32():
    assert autocast_dtype(Config(), CUDA) == (torch.bfloat16 if torch.cuda.is_bf16_supported() else None)
    model, _ = _lora_model()
    _, batch = _batch(model)
    with torch.no_grad():
        fp32 = TrainingLoss(model)(batch)
        bf16 = TrainingLoss(model, autocast=torch.bfloat16)(batch)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=2e-2)


def test_attention_auto_is_flash_or_sdpa_and_scores_as_eager():
    chosen = pretrained.choose_attention("auto", CUDA)
    assert chosen == ("flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa")
    dtype = "bfloat16" if chosen.startswith("flash") else "float32"
    auto, _ = pretrained.load("tiny-llama", dtype=dtype, device="cuda")
    eager, _ = pretrained.load("tiny-llama", dtype=dtype, device="cuda", attn_implementation="eager")
    assert auto.config._attn_implementation == chosen  # noqa: SLF001
    assert torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
    _, batch = _batch(auto)
    with torch.no_grad():
        tol = 3e-2 if dtype == "bfloat16" else 1e-4
        torch.testing.assert_close(per_example_loss(auto, batch), per_example_loss(eager, batch), rtol=tol, atol=tol)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_varlen_packing_with_flash_attention_scores_as_padding():
    model, _ = pretrained.load("tiny-llama", dtype="bfloat16", device="cuda", attn_implementation="flash_attention_2")
    assert packing_supported(model)
    seqs, padded = _batch(model, rows=6)
    packed = collate_packed(seqs).to(CUDA)
    with torch.no_grad():
        torch.testing.assert_close(per_example_loss(model, packed), per_example_loss(model, padded),
                                   rtol=3e-2, atol=3e-2)


def test_fused_adamw_on_cuda_matches_the_unfused_step():
    params = [torch.nn.Parameter(torch.randn(64, 32, device=CUDA)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = build_optimizer([(f"w{i}", p) for i, p in enumerate(params)], lr=1e-2)
    assert fused.defaults.get("fused") is True
    plain = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.0, fused=False, foreach=False)
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_compile_gives_the_eager_loss_and_gradients():
    model, _ = _lora_model()
    model.train()
    _, batch = _batch(model)
    eager = TrainingLoss(model)(batch).mean()
    eager.backward()
    grads = {n: p.grad.clone() for n, p in _adapters(model)}
    model.zero_grad(set_to_none=True)
    compiled = TrainingLoss(torch.compile(model))(batch).mean()
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    for n, p in _adapters(model):
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-5)


def test_mezo_dual_batch_on_cuda_equals_two_passes():
    dual_model, modules = _lora_model()
    two_model, _ = _lora_model()
    _, batch = _batch(dual_model)
    dual = MeZO(_adapters(dual_model), lr=1e-3, eps=1e-3, dual_modules=modules, seed=7)
    two = MeZO(_adapters(two_model), lr=1e-3, eps=1e-3, seed=7)
    for model in (dual_model, two_model):
        model.eval()
    for _ in range(2):
        got, want = dual.step(TrainingLoss(dual_model), batch), two.step(TrainingLoss(two_model), batch)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    for (_, p), (_, q) in zip(_adapters(dual_model), _adapters(two_model), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_full_model_mezo_in_bf16_on_cuda_draws_z_in_pieces_and_adds_little_memory():
    """An embedding-sized bf16 weight: the whole z (dual and momentum paths) is the sweeps' pieces, and a step
    adds a few pieces of memory, not fp32 copies of the weight."""
    weight = torch.nn.Parameter(torch.randn(49152, 2048, device=CUDA).to(torch.bfloat16))  # 100M elements
    mezo = MeZO([("embed.weight", weight)], lr=1e-3, eps=1e-3, seed=5)
    gens = mezo._seeded({}, [(weight, True)], 17)
    pieces = torch.cat([z.clone().flatten() for _, z in mezo._z_pieces(weight, gens)])
    assert torch.equal(mezo._z(weight, mezo._seeded({}, [(weight, True)], 17)).flatten(), pieces)
    del pieces
    losses = iter([torch.tensor([2.0], device=CUDA), torch.tensor([1.0], device=CUDA)] * 2)
    mezo.step(lambda batch: next(losses), {})  # the first step allocates the reused buffer
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before, theta = torch.cuda.memory_allocated(), weight.detach().clone()
    mezo.step(lambda batch: next(losses), {})
    added = torch.cuda.max_memory_allocated() - before - theta.numel() * 2  # the clone above is not the step's
    assert added < 256 * 2**20, f"a step added {added / 2**20:.0f} MiB over a {weight.numel() * 2 / 2**20:.0f} MiB weight"
    assert not torch.equal(weight, theta)


def test_activation_offloading_keeps_the_step_and_lowers_the_peak_memory():
    """--activation_offloading: the same step (loss and adapter weights) as on the GPU, at a lower peak."""
    results = []
    for offload in (False, True):
        model, _ = _lora_model()
        model.train()
        _, batch = _batch(model, rows=16, length=512)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        stepper = AdamWStepper(_adapters(model), TrainingLoss(model), micro_batch=16, offload=offload)
        loss = stepper.step(lambda batch=batch: batch, lr=1e-3)
        peak = torch.cuda.max_memory_allocated() - before
        results.append((loss, [p.detach().clone() for _, p in _adapters(model)], peak))
    (plain_loss, plain, plain_peak), (loss, offloaded, peak) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(offloaded, plain, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert peak < 0.8 * plain_peak, f"peak {peak / 2**20:.0f} MiB offloaded vs {plain_peak / 2**20:.0f} MiB"


def test_liger_kernels_give_the_same_loss_and_lora_gradients():
    """--use_liger_kernel: Liger's RMSNorm, RoPE and SwiGLU kernels, LoRA on every linear layer (the SwiGLU MLP's
    projections included) keep the loss and the adapters' gradients."""
    pytest.importorskip("liger_kernel")
    from xgblora.models.kernels import use_liger_kernels

    results = []
    for liger in (False, True):
        model, _ = pretrained.load("tiny-llama", dtype="float32", device="cuda")
        lora.attach(model, "all-linear", r=8,
                    alpha=16.0)
        with torch.no_grad():
            gen = torch.Generator("cuda").manual_seed(0)
            for _, p in _adapters(model):
                p.normal_(0, 0.05, generator=gen)
        if liger:
            use_liger_kernels(model, CUDA)
        model.train()
        _, batch = _batch(model, rows=4, length=64)
        loss = TrainingLoss(model)(batch).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for _, p in _adapters(model)]))
    (plain_loss, plain), (loss, grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-4, atol=1e-5)
    for g, h in zip(grads, plain, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-3, atol=1e-5)


def test_a_real_out_of_memory_halves_the_micro_batch_and_keeps_the_loss():
    model, _ = _lora_model()
    model.train()
    _, batch = _batch(model, rows=64, length=1024)
    with torch.no_grad():
        want = torch.cat([TrainingLoss(model)(batch.split(k, k + 8)) for k in range(0, 64, 8)]).mean()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 600 * 2**20) / total)
    try:
        stepper = AdamWStepper(_adapters(model), TrainingLoss(model), micro_batch=64)
        got = stepper.step(lambda: batch, lr=0.0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert stepper.micro_batch < 64
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_one_gpu_nccl_process_group_all_reduces():
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
                                             rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            assert torch.distributed.get_backend() == "nccl"
            dist = Distributed(types.SimpleNamespace(num_processes=1, process_index=0, device=CUDA))
            loss, grad = torch.tensor([1.5], device=CUDA), torch.randn(1000, device=CUDA)
            before = grad.clone()
            dist._all_reduce_mean([loss, grad], "the test all-reduce")  # noqa: SLF001 -- the NCCL path itself
            torch.cuda.synchronize()
            assert loss.item() == 1.5 and torch.equal(grad, before)
        finally:
            torch.distributed.destroy_process_group()


def test_the_padded_token_mean_loss_makes_no_host_sync():
    """The SFT loss after the model (target log-probs in chunks, token-mean weights, backward) queues its kernels
    without waiting on the GPU: torch raises on any synchronising call in sync debug mode 'error'."""
    seqs = synthetic_seqs(4, 48, 12, 512, seed=0)
    batch = collate(seqs, 0, pad_to_multiple_of=64).token_mean().to(CUDA)
    logits = torch.randn(4, batch.input_ids.shape[1], 512, device=CUDA, requires_grad=True)
    head = lambda **kw: types.SimpleNamespace(logits=logits[:, -kw["logits_to_keep"]:] * 1.0)  # noqa: E731
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        per_example_loss(head, batch).mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch.input_ids.shape[1] == 64 and torch.isfinite(logits.grad).all()
