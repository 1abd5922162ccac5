"""The GPU suite's pieces, checked on the CPU: step statistics, the FLOP count behind MFU, random models built on
their device, the profiler summary."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from xgblora.adapters import lora
from xgblora.bench import flops
from xgblora.bench.profile import format_profile, profile_slowest
from xgblora.bench.timing import step_stats
from xgblora.models import pretrained


@pytest.mark.parametrize("n", [1, 2, 7, 10, 23])
def test_step_stats_match_numpy(n):
    xs = list(np.random.default_rng(n).exponential(0.1, size=n))
    stats = step_stats(xs)
    assert stats["steps_s"] == xs and stats["n"] == n
    assert stats["mean_s"] == pytest.approx(np.mean(xs), rel=1e-12)
    assert stats["median_s"] == pytest.approx(np.median(xs), rel=1e-12)
    assert stats["p90_s"] == pytest.approx(np.percentile(xs, 90), rel=1e-12)
    assert stats["max_s"] == max(xs)


def test_step_stats_of_no_steps():
    assert step_stats([]) == {"n": 0, "mean_s": None, "median_s": None, "p90_s": None, "max_s": None, "steps_s": []}


def _counted(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_flops_per_token_equal_torch_flop_counter(name):
    """PaLM's count (2N + 4LTd forward, 3x that for full training, 4N + 12LTd + 6N_lora for LoRA) against torch's
    own FLOP counter on a forward and a forward + backward (eager attention: its matmuls are counted)."""
    model, _ = pretrained.random_model(name, attn_implementation="eager")
    batch, seq = 2, 16
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(0))
    tokens = batch * seq
    with torch.no_grad():
        assert _counted(lambda: model(input_ids=ids)) == tokens * flops.flops_per_token(model.config, seq, "forward")
    assert _counted(lambda: model(input_ids=ids).logits.sum().backward()) == \
        tokens * flops.flops_per_token(model.config, seq, "train_full")
    report = lora.attach(model, ["q_proj", "v_proj"], r=4)
    model.enable_input_require_grads()  # every layer's input gradient, as in a deep model past its first layer
    assert _counted(lambda: model(input_ids=ids).logits.sum().backward()) == \
        tokens * flops.flops_per_token(model.config, seq, "train_lora", report.trainable_params)


@pytest.mark.parametrize(("name", "head", "lm_head"), [("tiny-llama", "lm", True), ("tiny-opt", "lm", True),
                                                       ("tiny-bert", "embed", False)])
def test_matmul_params_count_the_linear_weights(name, head, lm_head):
    model, _ = pretrained.random_model(name, head=head)
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "pooler" not in n)  # BERT's pooler reads one token a row
    assert flops.matmul_params(model.config, lm_head) == linear


def test_mfu_from_the_peak_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert flops.peak_flops(torch.device("cuda")) == 989e12
    assert flops.mfu(1e5, 1e9, torch.device("cuda")) == pytest.approx(1e14 / 989e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert flops.peak_flops(torch.device("cuda")) == 756e12
    assert flops.mfu(1e5, 1e9, torch.device("cpu")) is None


class _LargestCpuTensor(TorchDispatchMode):
    """Records the largest tensor any op puts on the CPU."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.numel = max(self.numel, t.numel())
        return out


def test_random_model_is_built_on_its_device_in_its_dtype():
    """A 1B random model loaded for a device with build_on_device (the benchmarks) is created there (here the meta
    device: no memory, no time), never on the CPU and moved: no tensor of a weight's size exists on the CPU."""
    with _LargestCpuTensor() as largest:
        model, _ = pretrained.load("llama-1b-random", dtype="bfloat16", device="meta", build_on_device=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert largest.numel < 2048  # the smallest weight, a layer norm, has 2048 elements


def test_random_model_weights_come_from_the_cpu_by_default():
    """Without build_on_device the weights are the CPU's, whatever the device: one base model for a run trained on
    a GPU and exported on the CPU."""
    with _LargestCpuTensor() as largest:
        model, _ = pretrained.load("tiny-llama", device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"} and largest.numel >= 64 * 176


def test_random_model_on_the_cpu_keeps_its_weights():
    a, _ = pretrained.random_model("tiny-llama")
    b, _ = pretrained.random_model("tiny-llama", device=torch.device("cpu"), seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_profile_of_the_slowest_step():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(32, 64)
    replayed = []

    def replay(index):
        replayed.append(index)
        model(x).sum().backward()

    summary = profile_slowest([0.1, 0.5, 0.2], replay, torch.device("cpu"), top=5)
    assert replayed == [1] and summary["step"] == 1 and summary["timed_s"] == 0.5
    assert summary["sorted_by"] == "self CPU time" and summary["wall_s"] > 0
    ops = summary["ops"]
    assert 0 < len(ops) <= 5 and {"name", "calls", "self_s", "share"} <= set(ops[0])
    assert [o["self_s"] for o in ops] == sorted((o["self_s"] for o in ops), reverse=True)
    assert any("addmm" in o["name"] or "mm" in o["name"] for o in ops)
    assert 0 < sum(o["share"] for o in ops) <= 1 + 1e-9
    assert format_profile("x", summary).count("\n| `") == len(ops)
    assert profile_slowest([], replay, torch.device("cpu")) is None


def test_shape_comparison_runs_each_side_on_the_same_rows():
    from xgblora.bench import gpu, sft

    case = sft.SFTCase(model_name="tiny-llama", packed=False, checkpointing=False, batch_size=2, steps=1, warmup=1,
                       max_length=96)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    res = sft.shape_case(case)
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn  # restored
    sides = res["sides"]
    assert list(sides) == [label for label, _, _ in sft.SHAPE_SIDES]
    exact, _, widened = sides.values()
    assert all(s["n"] == 1 and len(s["xgblora_widths"]) == 2 for s in sides.values())
    assert exact["xgblora_widths"] == exact["trl_widths"]  # the longest row of each step
    assert all(w % 64 == 0 and 0 <= w - t < 64 for w, t in zip(widened["xgblora_widths"], exact["trl_widths"],
                                                                strict=True))
    assert widened["xgblora_new_width"][0] and exact["xgblora_new_width"][0]
    table = gpu.format_table({"cuda": False, "elapsed_s": 1.0, "parts": {"sft_shapes": {"status": "ran",
                                                                                        "results": res}}})
    assert table.count("| sft_shapes | padded widths") == 3


def test_gpu_suite_saves_after_every_part_and_skips_what_does_not_fit(monkeypatch):
    """The CUDA branch's bookkeeping, with stand-in parts: a part starts only while its estimate fits the budget,
    and the report is saved after the CUDA tests and after every part that ran."""
    import argparse

    from xgblora.bench import flags, gpu

    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--suite", "gpu", "--gpu_budget_s", "100"])
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "cuda_tests", lambda budget, path: {"status": "ran", "passed": 1, "tests": {}})
    monkeypatch.setattr(gpu, "ESTIMATE_S", {**gpu.ESTIMATE_S, "sft": 1, "grpo": 10**6, "embed": 1})

    def broken():
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gpu, "cuda_parts", lambda a: [("one", "sft", lambda: {"ok": a.device}),
                                                      ("two", "grpo", lambda: {}), ("three", "embed", broken)])
    saved = []
    report = gpu.run(args, save=lambda r: saved.append({k: dict(v) for k, v in r["parts"].items()}))
    parts = report["parts"]
    assert parts["one"]["status"] == "ran" and parts["one"]["results"] == {"ok": "cuda"}
    assert parts["two"]["status"].startswith("skipped") and parts["two"]["estimate_s"] == 10**6
    assert parts["three"]["status"] == "failed: RuntimeError: out of memory"
    assert [list(s) for s in saved] == [["cuda_tests"], ["cuda_tests", "one"], ["cuda_tests", "one", "two", "three"]]
    assert "| two | skipped" in gpu.format_table(report)


def test_every_cuda_part_can_be_chosen_and_is_estimated_and_tabled():
    """Each part of the GPU run is a --gpu_parts choice with a time estimate, and a comparison's results reach the
    report's step table (each side's steps, as measured)."""
    import argparse

    from xgblora.bench import flags, gpu

    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    keys = [key for _, key, _ in gpu.cuda_parts(parser.parse_args(["--suite", "gpu"]))]
    assert set(keys) | {"cuda_tests"} == set(flags.GPU_PARTS) == set(gpu.ESTIMATE_S)
    side = {"n": 2, "mean_s": 1.5, "median_s": 1.5, "p90_s": 1.9, "max_s": 2.0, "steps_s": [1.0, 2.0]}
    dpo = [{"model_name": "llama-100m-128k-random", "speedup_vs_trl": 1.7, "xgblora_step_stats": side,
            "trl_step_stats": side}]
    table = gpu.format_table({"cuda": True, "elapsed_s": 3.0, "parts": {"dpo": {"status": "ran", "results": dpo}}})
    assert "llama-100m-128k-random 1.70x TRL's steps/s" in table
    assert "| dpo | llama-100m-128k-random trl | 1.5 | 1.5 | 1.9 | 2 | n/a | 1 2 |" in table
