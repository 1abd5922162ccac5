"""`xgblora bench` in --quick mode: every required figure is present, finite and positive; the table prints."""

import argparse
import json
import math
import subprocess
import types

import pytest
import torch

from xgblora import cli
from xgblora.bench import flags, gpu, sft, suites, table, timing, workloads
from xgblora.bench.baselines import hf_vs_xgblora


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    return parser.parse_args(["--quick", "--model_name", "tiny-opt", "--device", "cpu",
                              "--json", str(tmp_path / "bench.json"), *extra])


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("taken", ["bench.json", "bench.md"])
def test_bench_never_writes_over_a_file(tmp_path, capsys, taken):
    """--json FILE (or the Markdown table beside it) that exists: one line, exit 2, before anything is measured."""
    (tmp_path / taken).write_text("mine\n")
    assert cli.main(["bench", "--quick", "--model_name", "tiny-opt", "--device", "cpu",
                     "--json", str(tmp_path / "bench.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / taken} already exists" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [taken] and (tmp_path / taken).read_text() == "mine\n"


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--batch_size", "-1", "--batch_size must be positive, got -1"),
    ("--batch_size", "0", "--batch_size must be positive, got 0"),
    ("--repeats", "0", "--repeats must be positive, got 0"),
    ("--warmup", "-1", "--warmup must be 0 or more, got -1"),
    ("--embed_batches", "0", "--embed_batches must be positive, got 0"),
])
def test_bench_sizes_out_of_range_are_one_line_before_anything_runs(tmp_path, capsys, flag, value, message):
    assert cli.main(["bench", "--quick", "--model_name", "tiny-opt", "--device", "cpu", flag, value,
                     "--json", str(tmp_path / "bench.json")]) == 2
    assert capsys.readouterr().err == f"xgblora bench: error: {message}\n"
    assert not list(tmp_path.iterdir())


def test_bench_quick_writes_every_key_and_prints_the_table(tmp_path, capsys):
    assert suites.main(_args(tmp_path, "--skip_hf")) == 0
    out = capsys.readouterr().out
    assert "MeZO LoRA step / two forwards" in out and "target" in out
    res = json.loads((tmp_path / "bench.json").read_text())
    for key in (*table.TARGETS, "log_overhead_fraction"):  # every headline figure
        if key == "fo_lora_speedup_vs_hf_peft":
            assert res[key] is None  # --skip_hf
            continue
        assert _positive(res[key]), (key, res[key])
    for key in ("forward_s", "two_forwards_s", "zo_step_s", "zo_full_step_s", "adamw_lora_step_s",
                "fo_lora_train_tokens_per_s", "eval_examples_per_s", "peak_mem_inference_mb", "peak_mem_zo_mb"):
        assert _positive(res[key]), (key, res[key])
    assert res["device"] == "cpu" and res["versions"]["torch"]
    assert res["batch_size"] == 2 and res["seq_len"] == 32
    assert res["eval_source"].startswith("synthetic") and res["eval_candidates_per_example"] == 2
    assert res["eval_mean_prompt_tokens"] > 50  # RTE-length prompts, not toy ones


def test_eval_workload_reads_real_dev_rows(tmp_path, glue_data):
    args = _args(tmp_path, "--data_dir", str(glue_data), "--eval_task", "CB", "--eval_examples", "5")
    examples, source = workloads.eval_examples(args)
    assert len(examples) == 5 and "CB dev rows" in source
    first = json.loads((glue_data / "cb" / "dev.jsonl").read_text().splitlines()[0])
    assert first["premise"] in examples[0].prompt and examples[0].candidates == ("Yes", "No", "Maybe")


def test_hf_peft_baseline_gives_a_speedup(tmp_path):
    pytest.importorskip("peft")
    b = workloads.Bench(flags.apply_quick(_args(tmp_path)))
    res = hf_vs_xgblora(b, steps=3, warmup=1)
    assert res["hf_steps_timed"] == 3
    assert _positive(res["fo_lora_speedup_vs_hf_peft"])
    assert _positive(res["hf_peft_train_tokens_per_s"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU part; with a GPU the suite runs its CUDA part")
def test_gpu_suite_runs_its_cpu_part_and_names_what_needs_cuda(tmp_path, capsys):
    args = _args(tmp_path, "--suite", "gpu")
    assert suites.main(args) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    parts = res["parts"]
    assert res["cuda"] is False and (tmp_path / "bench.md").read_text().startswith("GPU suite (no CUDA")
    tests = parts["cuda_tests"]["tests"]
    assert len(tests) >= 8 and all(t["outcome"] == "skipped" and t["message"] for t in tests.values())
    assert _positive(parts["cpu_bench"]["zo_step_over_two_forwards"])
    for name in ("bench:llama-1b-random", "bench:opt-1.3b-random", "sft", "sft_shapes", "grpo", "embed", "icl",
                 "compile"):
        assert parts[name]["status"] == "needs CUDA" and _positive(parts[name]["estimate_s"])
    stats = parts["cpu_bench"]["step_stats"]["adamw_lora_step"]
    assert len(stats["steps_s"]) == 2 and stats["max_s"] >= stats["median_s"] and stats["mfu"] is None  # CPU
    assert parts["cpu_bench"]["profiles"]["adamw_lora_step"]["ops"]
    out = capsys.readouterr().out
    assert "needs CUDA" in out and "| cpu_bench | adamw_lora_step |" in out and "top ops by self CPU time" in out


def test_gpu_suite_reads_the_cuda_tests_from_the_path_it_is_given(tmp_path, monkeypatch):
    """The installed package never reaches into a checkout's tests/: the file comes from the command line (default
    relative to where the command runs)."""
    monkeypatch.chdir(tmp_path)
    assert gpu.cuda_tests(60.0)["status"] == "not run"
    calls = []
    monkeypatch.setattr(gpu.subprocess, "run", lambda command, **kwargs: calls.append(command) or
                        subprocess.CompletedProcess(command, 5, "", ""))
    (tmp_path / "cuda_checks.py").write_text("")
    assert gpu.cuda_tests(60.0, "cuda_checks.py")["status"] == "ran"
    assert calls and "cuda_checks.py" in calls[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU part; with a GPU the suite runs its CUDA part")
def test_gpu_suite_runs_only_the_parts_named(tmp_path):
    assert suites.main(_args(tmp_path, "--suite", "gpu", "--gpu_parts", "sft", "compile")) == 0
    parts = json.loads((tmp_path / "bench.json").read_text())["parts"]
    assert set(parts) == {"cpu_bench", "sft", "compile"}


@pytest.mark.parametrize("alternate", [True, False])
def test_interleaved_steps_order_the_sides_and_time_each_apart(alternate):
    clock, order = [0.0], []
    monkey_time = types.SimpleNamespace(perf_counter=lambda: clock[0])

    def ours(index):
        order.append(("ours", index))
        clock[0] += 1.0

    steps = timing.InterleavedSteps(ours, torch.device("cpu"), warmup=1, alternate=alternate)
    real_time, timing.time = timing.time, monkey_time
    try:
        steps.start()
        for index in range(4):  # as the HF Trainer calls back: begin at global_step = index, end at index + 1
            steps.on_step_begin(index)
            order.append(("trainer", index))
            clock[0] += 10.0
            steps.on_step_end(index)
    finally:
        timing.time = real_time
    if alternate:  # odd steps: ours meets the batch first
        assert order == [("trainer", 0), ("ours", 0), ("ours", 1), ("trainer", 1),
                         ("trainer", 2), ("ours", 2), ("ours", 3), ("trainer", 3)]
    else:
        assert order == [(side, i) for i in range(4) for side in ("trainer", "ours")]
    assert steps.trainer_s == [10.0, 10.0, 10.0] and steps.ours_s == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("data", [pytest.param("generated", marks=pytest.mark.slow), "gsm8k"])
def test_sft_suite_quick_compares_with_trl_on_the_same_tokens(tmp_path, request, capsys, monkeypatch, data):
    pytest.importorskip("trl")
    stepped = []
    real_rows = sft.step_rows
    monkeypatch.setattr(sft, "step_rows", lambda case, index: stepped.append(index) or real_rows(case, index))
    source = ["--data_dir", str(request.getfixturevalue("glue_data"))] if data == "gsm8k" else []
    args = _args(tmp_path, "--suite", "sft", "--sft_models", "tiny-llama-chat", "--sft_variants", "padded", "packed",
                 *source, "--skip_memory")
    assert suites.main(args) == 0
    assert ("no --data_dir: timing on generated GSM8K-shaped conversations" in capsys.readouterr().err) == (not source)
    cases = json.loads((tmp_path / "bench.json").read_text())["cases"]
    assert [c["variant"] for c in cases] == ["padded", "packed"]
    # per variant: xgblora stepped once on each TRL step's rows, in TRL's order (HF's step callbacks count as
    # assumed), then the timed steps' tokens were counted, every step's padded width read (padded only), and the
    # slowest timed step replayed under the profiler
    padded, packed = stepped[:9], stepped[9:]
    assert padded[:8] == [0, 1, 2, 1, 2, 0, 1, 2] and packed[:5] == [0, 1, 2, 1, 2] and len(packed) == 6
    assert padded[8] in (1, 2) and packed[5] in (1, 2)
    for c in cases:
        assert c["steps_timed"] == 2 and _positive(c["speedup_vs_trl"]) and 0 < c["target_share"] < 1
        assert _positive(c["trl_target_tokens_per_s"]) and c["xgblora_tokens_per_s"] > c["xgblora_target_tokens_per_s"]
        assert c["xgblora_step_stats"]["steps_s"] == c["xgblora_step_s"] and c["trl_step_stats"]["n"] == 2
        assert c["xgblora_profile"]["step"] in (0, 1) and c["xgblora_mfu"] is None  # no peak known for a CPU
        assert c["trl_mixed_precision"] == "no"  # fp32 as xgblora's side, not TRL's default bf16 autocast
    assert cases[0]["xgblora_widths"] == cases[0]["trl_widths"]  # the CPU pads to the longest row


def test_sft_rows_for_trl_carry_loss_exactly_where_xgblora_does():
    from xgblora.bench import sft
    from xgblora.data.tasks import Example

    tok = sft.chat_tokenizer("tiny-llama-chat")
    ex = Example("", (), (), messages=(("user", "What is 2 + 2?"), ("assistant", "It is 4.")))
    seq = sft.formats.instruction_seqs(tok, [ex], 1024)[0]
    row = sft.trl_rows([seq])[0]
    scored = [i for i, label in enumerate(row["labels"]) if label != -100]
    assert scored == seq.target_offsets() and all(row["labels"][i] == row["input_ids"][i] for i in scored)
    assert tok.decode([row["input_ids"][i] for i in scored]).startswith("It is 4.")


def test_gpu_suite_reports_hung_cuda_tests_and_goes_on(monkeypatch):
    def hang(command, timeout, **kwargs):
        raise subprocess.TimeoutExpired(command, timeout, output=b"tests/test_cuda.py ..")
    monkeypatch.setattr(gpu.subprocess, "run", hang)
    part = gpu.cuda_tests(60.0)
    assert part == {"status": "failed: timed out after 60 s", "output_tail": "tests/test_cuda.py .."}


def test_the_liger_variant_asks_both_sides_for_ligers_kernels_and_a_cpu_run_refuses_it(tmp_path, monkeypatch):
    """`--sft_variants padded+liger`: xgblora's model through `use_liger_kernels` (one line off CUDA), TRL's config
    with `use_liger_kernel`, everything else as the padded case."""
    trl = pytest.importorskip("trl")
    from xgblora.bench import sft
    from xgblora.errors import UserError

    args = _args(tmp_path, "--suite", "sft", "--sft_models", "tiny-llama-chat", "--sft_variants", "padded+liger")
    (case,) = sft.cases(args)
    assert (case.variant, case.liger, case.packed, case.fused_head) == ("padded+liger", True, False, True)
    seqs = sft.sft_seqs(case)
    with pytest.raises(UserError, match="--use_liger_kernel: Liger's kernels are Triton kernels for CUDA devices"):
        sft.XgbloraSFT(case, seqs)
    configured = []

    class Recorded(trl.SFTConfig):
        def __init__(self, **kwargs):
            configured.append(kwargs)
            raise RuntimeError("recorded")

    monkeypatch.setattr(trl, "SFTConfig", Recorded)
    with pytest.raises(RuntimeError, match="recorded"):
        sft.trl_trainer(case, seqs, [], str(tmp_path))
    assert configured[0]["use_liger_kernel"] is True and configured[0]["bf16"] is False
