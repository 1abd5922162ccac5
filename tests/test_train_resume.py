"""Exact resume of training runs on tiny-opt: Ctrl-C, a crash, the console script, checkpoint pruning, runtime."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import adapter, assert_same_tensors, interrupt_at, make_cfg, records

from xgblora import checkpoint, cli, train
from xgblora.logs import read_metrics
from xgblora.recipes import sft
from xgblora.train import loop

# ----------------------------------------------------------------------------- exact resume

RESUME_CASES = {
    # merges at 4 (before the stop) and 8, 12 (after); one of three layers carries each booster
    "xgblora-adamw": dict(method="xgblora", trainer="regular", max_steps=14, xgblora_steps_per_iteration=4,
                          xgblora_layers_per_booster=1, lr_scheduler_type="linear", warmup_steps=2, logging_steps=3,
                          lora_target_modules="q_proj,v_proj,fc1"),
    # each booster starts from the gradient of 2 training batches: the stream advances beyond the steps' batches
    "xgblora-adamw-gradient-init": dict(method="xgblora", trainer="regular", max_steps=14, xgblora_steps_per_iteration=4,
                                        xgblora_init="gradient", xgblora_init_batches=2, logging_steps=3),
    "lora-mezo-dual": dict(method="lora", trainer="zo", max_steps=14, learning_rate=1e-3, lr_scheduler_type="linear",
                           logging_steps=3),
    # anchors at steps 1, 6, 11: the stop at 7 is mid-epoch, with Adam moments in flight
    "lora-svrg-adam": dict(method="lora", trainer="zo", zo_estimator="svrg", zo_svrg_period=5,
                           zo_svrg_anchor_batches=2, zo_optimizer="adam", max_steps=14, learning_rate=1e-3,
                           logging_steps=3),
    # boosters merged at 4, 8, 12 drop their momentum
    "xgblora-fzoo-momentum": dict(method="xgblora", trainer="zo", zo_estimator="fzoo", zo_queries=3,
                                  zo_optimizer="momentum", max_steps=14, xgblora_steps_per_iteration=4,
                                  learning_rate=1e-3, logging_steps=3),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_sigint_then_resume_equals_an_uninterrupted_run(glue_data, tmp_path, monkeypatch, case):
    overrides = RESUME_CASES[case]
    whole = tmp_path / "whole"
    expected = sft.run(make_cfg(glue_data, whole, **overrides))

    split = tmp_path / "split"
    with pytest.raises(KeyboardInterrupt, match="stopped at step 7"):  # mid logging window (3), between merges
        sft.run(make_cfg(glue_data, split, **overrides), hooks=interrupt_at(7))
    assert checkpoint.load_requested(split / "checkpoints", "latest")[0].name == "step-7"
    assert not (split / "results.json").exists()
    got = sft.run(make_cfg(glue_data, split, resume_from_checkpoint="latest", **overrides))

    assert_same_tensors(adapter(split), adapter(whole))
    assert records(split) == records(whole)
    if overrides["method"] == "xgblora":
        assert [r["step"] for r in records(whole) if r.get("event") == "merge"] == [4, 8, 12]
    for key in ("steps", "train_loss", "accuracy", "boosters", "trainable_params"):
        assert got[key] == expected[key], key


def test_crash_after_a_periodic_checkpoint_resumes_exactly(glue_data, tmp_path, monkeypatch):
    overrides = dict(RESUME_CASES["xgblora-adamw"], save_steps=5)
    whole = tmp_path / "whole"
    sft.run(make_cfg(glue_data, whole, **overrides))

    split = tmp_path / "split"
    with pytest.raises(RuntimeError, match="simulated crash"):  # the last checkpoint is step-5; 6..9 are redone
        sft.run(make_cfg(glue_data, split, **overrides), hooks=interrupt_at(9, how="crash"))
    assert [p.name for p in checkpoint.step_checkpoints(split / "checkpoints")] == ["step-5"]
    assert any(r["step"] > 5 for r in read_metrics(split / "metrics.jsonl"))  # logged before the crash
    sft.run(make_cfg(glue_data, split, resume_from_checkpoint="latest", **overrides))

    assert_same_tensors(adapter(split), adapter(whole))
    assert records(split) == records(whole)


def test_sigint_to_the_console_script_checkpoints_and_resume_finishes(glue_data, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data),
            "--num_train", "64", "--num_eval", "16", "--method", "lora", "--trainer", "regular",
            "--learning_rate", "3e-3", "--max_steps", "300", "--logging_steps", "1", "--max_length", "64",
            "--per_device_train_batch_size", "8", "--output_dir", str(out), "--result_file",
            str(out / "mezo.json"), "--device", "cpu"]
    script = Path(sys.executable).with_name("xgblora")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "xgblora.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.stat().st_size > 0:  # records reach the file 20 at a time
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    step = int(lines[0].split("stopped at step ")[1].split(";")[0])
    assert 0 < step < 300
    assert (out / "checkpoints" / f"step-{step}").is_dir()
    assert not (out / "results.json").exists()

    assert cli.main(args + ["--resume_from_checkpoint", "latest"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 300
    logged = [r["step"] for r in read_metrics(metrics) if "loss" in r]
    assert logged == list(range(1, 301))


def test_save_total_limit_counts_the_stop_checkpoint_and_never_prunes_best(glue_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(glue_data, out, max_steps=12, save_steps=2, save_total_limit=2, evaluation_strategy="steps",
                   eval_steps=2, num_dev=16, load_best_model_at_end=True)
    root = out / "checkpoints"
    with pytest.raises(KeyboardInterrupt, match="stopped at step 7"):
        sft.run(cfg, hooks=interrupt_at(7))
    assert [p.name for p in checkpoint.step_checkpoints(root)] == ["step-6", "step-7"]
    best_step = checkpoint.read_checkpoint(root / "best")[1]["step"]
    sft.run(dataclasses.replace(cfg, resume_from_checkpoint="latest"))
    assert [p.name for p in checkpoint.step_checkpoints(root)] == ["step-8", "step-10"]
    assert checkpoint.read_checkpoint(root / "best")[1]["step"] >= best_step  # kept (or bettered), never pruned


def test_a_resumed_run_counts_the_time_of_every_part_and_its_resumes(glue_data, tmp_path, monkeypatch):
    """A fake training clock that each step moves on: 10 s a step before the Ctrl-C at step 7, 1 s a step after."""
    clock = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def tick(seconds: float) -> train.Hooks:
        return train.Hooks(on_step_end=[lambda state: clock.__setitem__(0, clock[0] + seconds)])

    out = tmp_path / "run"
    cfg = make_cfg(glue_data, out, max_steps=14, logging_steps=1, save_strategy="no", no_eval=True)
    with pytest.raises(KeyboardInterrupt, match="stopped at step 7"):
        sft.run(cfg, hooks=train.Hooks(on_step_end=tick(10.0).on_step_end + interrupt_at(7).on_step_end))
    saved = checkpoint.read_checkpoint(out / "checkpoints" / "step-7")[1]
    assert (saved["runtime_s"], saved["resumes"]) == (70.0, 0)
    results = sft.run(dataclasses.replace(cfg, resume_from_checkpoint="latest"), hooks=tick(1.0))
    assert (results["train_runtime_s"], results["resumes"]) == (77.0, 1)
    assert results["steps_per_second"] == round(14 / 77, 4)
    assert json.loads((out / "results.json").read_text())["resumes"] == 1
    elapsed = [r["elapsed_s"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert elapsed == [10.0 * s for s in range(7)] + [70.0 + s for s in range(7)]  # logged before the step's tick


