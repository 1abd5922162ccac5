"""The training loop end to end on tiny-opt and the shared SST-2/CB rows: learning, exact resume, signals, outputs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import adapter, assert_same_tensors, interrupt_at, make_cfg, records

from xgblora import checkpoint, cli, parsing, perf, train
from xgblora.adapters.boosting import Boosting
from xgblora.config import Config
from xgblora.data.splits import sample_splits
from xgblora.data.tasks import get_task
from xgblora.errors import UserError
from xgblora.logs import read_metrics
from xgblora.recipes import sft
from xgblora.train import loop, objective
from xgblora.train import results as results_mod

# ----------------------------------------------------------------------------- learning

def test_adamw_lora_lowers_the_training_loss(shared_data, tmp_path):
    out = tmp_path / "run"
    sft.run(make_cfg(shared_data, out, max_steps=36, logging_steps=3))
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 12
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.1, losses


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
def test_sigint_then_resume_equals_an_uninterrupted_run(shared_data, tmp_path, monkeypatch, case):
    overrides = RESUME_CASES[case]
    whole = tmp_path / "whole"
    expected = sft.run(make_cfg(shared_data, whole, **overrides))

    split = tmp_path / "split"
    with pytest.raises(KeyboardInterrupt, match="stopped at step 7"):  # mid logging window (3), between merges
        sft.run(make_cfg(shared_data, split, **overrides), hooks=interrupt_at(7))
    assert checkpoint.load_requested(split / "checkpoints", "latest")[0].name == "step-7"
    assert not (split / "results.json").exists()
    got = sft.run(make_cfg(shared_data, split, resume_from_checkpoint="latest", **overrides))

    assert_same_tensors(adapter(split), adapter(whole))
    assert records(split) == records(whole)
    if overrides["method"] == "xgblora":
        assert [r["step"] for r in records(whole) if r.get("event") == "merge"] == [4, 8, 12]
    for key in ("steps", "train_loss", "accuracy", "boosters", "trainable_params"):
        assert got[key] == expected[key], key


@pytest.mark.parametrize("options, started_at, orthogonal", [
    ({}, [0, 1, 2], True), (dict(xgblora_init="gradient"), [0, 1, 2], False),
    (dict(xgblora_init="gradient-orthogonal"), [0, 1, 2], True), (dict(xgblora_init="random"), [], None),
    (dict(trainer="zo"), [], None)], ids=["default", "asked", "orthogonal", "random", "zo"])
def test_gradient_init_starts_every_booster_and_only_those(shared_data, tmp_path, monkeypatch, options, started_at,
                                                           orthogonal):
    """Under AdamW, by default or when asked, the first booster and each one after a merge start from the gradient
    (not one merged at the last step), off earlier boosters' directions under gradient-orthogonal (the default);
    --xgblora_init random and --trainer zo start none."""
    started = []
    original = Boosting.init_from_gradients

    def spy(self, backward, reduce=None, orthogonal=False):
        started.append((len(self.history), orthogonal))
        original(self, backward, reduce, orthogonal)

    monkeypatch.setattr(Boosting, "init_from_gradients", spy)
    sft.run(make_cfg(shared_data, tmp_path / "run", method="xgblora", max_steps=12, xgblora_steps_per_iteration=4,
                       xgblora_init_batches=1, **options))
    # boosters merged at 4 and 8 are followed by a new one; the one at 12 is not
    assert started == [(booster, orthogonal) for booster in started_at]


@pytest.mark.parametrize("init", ["gradient", "gradient-orthogonal"])
def test_zo_refuses_the_gradient_init_with_the_reason(shared_data, tmp_path, init):
    with pytest.raises(UserError, match=f"--xgblora_init {init} needs the gradient of each adapted weight"):
        make_cfg(shared_data, tmp_path / "zo", method="xgblora", trainer="zo", xgblora_init=init)


def test_crash_after_a_periodic_checkpoint_resumes_exactly(shared_data, tmp_path, monkeypatch):
    overrides = dict(RESUME_CASES["xgblora-adamw"], save_steps=5)
    whole = tmp_path / "whole"
    sft.run(make_cfg(shared_data, whole, **overrides))

    split = tmp_path / "split"
    with pytest.raises(RuntimeError, match="simulated crash"):  # the last checkpoint is step-5; 6..9 are redone
        sft.run(make_cfg(shared_data, split, **overrides), hooks=interrupt_at(9, how="crash"))
    assert [p.name for p in checkpoint.step_checkpoints(split / "checkpoints")] == ["step-5"]
    assert any(r["step"] > 5 for r in read_metrics(split / "metrics.jsonl"))  # logged before the crash
    sft.run(make_cfg(shared_data, split, resume_from_checkpoint="latest", **overrides))

    assert_same_tensors(adapter(split), adapter(whole))
    assert records(split) == records(whole)


def test_sigint_to_the_console_script_checkpoints_and_resume_finishes(shared_data, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(shared_data),
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


# ----------------------------------------------------------------------------- outputs

def test_metrics_results_and_config_of_a_run(shared_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(shared_data, out, method="xgblora", xgblora_steps_per_iteration=3, max_steps=8, logging_steps=2,
                   xgblora_preset="plain",  # every layer carries each booster: final/ holds all the adapters
                   evaluation_strategy="steps", eval_steps=4, num_dev=16, tag="t1")
    asked = dataclasses.replace(cfg)
    results = sft.run(cfg)

    log = read_metrics(out / "metrics.jsonl")
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4, 6, 8]
    for r in steps:
        assert {"step", "loss", "lr", "elapsed_s"} <= r.keys() and math.isfinite(r["loss"])
        assert r["lr"] == pytest.approx(cfg.learning_rate)
    evals = [r for r in log if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    merges = [r for r in log if r.get("event") == "merge"]
    assert [(r["step"], r["booster"]) for r in merges] == [(3, 1), (6, 2)]

    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(results))
    for key in ("accuracy", "trainable_params", "steps", "train_runtime_s", "peak_memory_mb"):
        assert key in saved, key
    assert saved["steps"] == 8 and saved["boosters"] == 2
    assert saved["trainable_params"] == sum(t.numel() for k, t in adapter_params(out).items())
    assert json.loads(Path(cfg.result_file).read_text()) == saved

    reread = Config(**parsing.read_yaml(Config, str(out / "config.yaml")))
    assert reread == asked


def adapter_params(out: Path) -> dict[str, torch.Tensor]:
    """The current (last, rank-1) booster of each module in final/: the shape of what trains at any one time."""
    tensors = adapter(out)
    return {k: t[-1:] if ".lora_A." in k else t[:, -1:] for k, t in tensors.items()}


def test_result_copy_only_when_asked_and_never_over_another_runs_file(shared_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft.run(make_cfg(shared_data, tmp_path / "plain", trainer="zo", max_steps=1, result_file=None))
    assert not (tmp_path / "result").exists()  # nothing lands in the working directory unasked

    cfg = make_cfg(shared_data, tmp_path / "run", trainer="zo", max_steps=2, result_file="auto", num_dev=8)
    expected = tmp_path / "result" / f"{results_mod.result_file_tag(cfg)}-trainset0.json"
    assert expected.name == "SST2-tiny-opt-sampleeval16-ntrain64-ndev8-trainset0.json"
    expected.parent.mkdir()
    expected.write_text("a user's file")
    sft.run(cfg)
    assert expected.read_text() == "a user's file"
    second = expected.with_name(expected.stem + "-2.json")
    assert json.loads(second.read_text()) == json.loads((tmp_path / "run" / "results.json").read_text())


@pytest.mark.parametrize("flags", [dict(load_best_model_at_end=True), dict(evaluation_strategy="steps", eval_steps=1)])
def test_choosing_on_dev_needs_a_dev_split(shared_data, tmp_path, flags):
    with pytest.raises(UserError, match=r"needs a dev split.*pass --num_dev N"):
        sft.run(make_cfg(shared_data, tmp_path / "run", max_steps=2, num_dev=None, **flags))


def test_save_total_limit_and_load_best_model_at_end(shared_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(shared_data, out, max_steps=12, save_steps=2, save_total_limit=2, evaluation_strategy="steps",
                   eval_steps=2, num_dev=32, load_best_model_at_end=True, learning_rate=2e-2)
    sft.run(cfg)
    root = out / "checkpoints"
    assert [p.name for p in checkpoint.step_checkpoints(root)] == ["step-8", "step-10"]

    evals = [(r["step"], r["eval_accuracy"]) for r in read_metrics(out / "metrics.jsonl") if "eval_accuracy" in r]
    assert [s for s, _ in evals] == [2, 4, 6, 8, 10, 12]
    best_value = max(v for _, v in evals)
    best_step = next(s for s, v in evals if v == best_value)  # the first step reaching the best value
    tensors, state, _ = checkpoint.read_checkpoint(root / "best")
    assert state["step"] == best_step and state["best"] == {"value": best_value, "score": best_value, "step": best_step}

    final = adapter(out)
    for name, value in tensors.items():
        peft = f"base_model.model.{name}.weight"
        assert torch.equal(final[peft], value), name


def test_save_total_limit_counts_the_stop_checkpoint_and_never_prunes_best(shared_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(shared_data, out, max_steps=12, save_steps=2, save_total_limit=2, evaluation_strategy="steps",
                   eval_steps=2, num_dev=16, load_best_model_at_end=True)
    root = out / "checkpoints"
    with pytest.raises(KeyboardInterrupt, match="stopped at step 7"):
        sft.run(cfg, hooks=interrupt_at(7))
    assert [p.name for p in checkpoint.step_checkpoints(root)] == ["step-6", "step-7"]
    best_step = checkpoint.read_checkpoint(root / "best")[1]["step"]
    sft.run(dataclasses.replace(cfg, resume_from_checkpoint="latest"))
    assert [p.name for p in checkpoint.step_checkpoints(root)] == ["step-8", "step-10"]
    assert checkpoint.read_checkpoint(root / "best")[1]["step"] >= best_step  # kept (or bettered), never pruned


def test_a_resumed_run_counts_the_time_of_every_part_and_its_resumes(shared_data, tmp_path, monkeypatch):
    """A fake training clock that each step moves on: 10 s a step before the Ctrl-C at step 7, 1 s a step after."""
    clock = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def tick(seconds: float) -> train.Hooks:
        return train.Hooks(on_step_end=[lambda state: clock.__setitem__(0, clock[0] + seconds)])

    out = tmp_path / "run"
    cfg = make_cfg(shared_data, out, max_steps=14, logging_steps=1, save_strategy="no", no_eval=True)
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


def test_load_best_model_at_end_with_xgblora_exports_the_best_model(shared_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(shared_data, out, method="xgblora", xgblora_steps_per_iteration=2, max_steps=8, save_strategy="no",
                   evaluation_strategy="steps", eval_steps=2, num_dev=32, load_best_model_at_end=True,
                   learning_rate=5e-2)
    sft.run(cfg)
    _, state, blobs = checkpoint.read_checkpoint(out / "checkpoints" / "best")
    history = blobs["boosting"]["history"]
    assert len(history) == state["step"] // 2 >= 1  # a merge every 2 steps, each before that step's evaluation
    # final/ must hold the boosters of the best model (their summed delta), not boosters merged after it
    final = adapter(out)
    expected: dict[str, torch.Tensor] = {}
    for booster in history:
        for name, rec in booster["modules"].items():
            expected[name] = expected.get(name, 0) + rec["scale"] * rec["B"] @ rec["A"]
    assert expected
    for name, delta in expected.items():
        A = final[f"base_model.model.{name}.lora_A.weight"]
        B = final[f"base_model.model.{name}.lora_B.weight"]
        torch.testing.assert_close(B @ A, delta)


# ----------------------------------------------------------------------------- objectives

@pytest.mark.parametrize("trainer", ["regular", "zo"])
@pytest.mark.parametrize("task", ["SST2", "CB"])
def test_train_as_classification_starts_near_log_candidates(shared_data, tmp_path, trainer, task):
    cfg = make_cfg(shared_data, tmp_path / "run", task_name=task, trainer=trainer, train_as_classification=True,
                   max_steps=4, logging_steps=1, learning_rate=1e-4, no_eval=True, num_train=32)
    candidates = {len(ex.candidates) for ex in sample_splits(get_task(task, cfg.data), cfg.data).train}
    assert len(candidates) == 1
    results = sft.run(cfg)
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(math.log(candidates.pop()), abs=0.15)
    assert results["steps"] == 4 and math.isfinite(results["train_loss"])


def test_nan_loss_stops_with_a_one_line_error_naming_the_step(shared_data, tmp_path, monkeypatch):
    real = objective.per_example_loss
    calls = {"n": 0}

    def poisoned(model, batch, *objectives):
        calls["n"] += 1
        loss = real(model, batch, *objectives)
        return loss * float("nan") if calls["n"] >= 3 else loss

    monkeypatch.setattr(objective, "per_example_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(UserError) as info:  # a checkpoint every step: step-3 and step-4 were saved after the NaN
        sft.run(make_cfg(shared_data, out, max_steps=10, logging_steps=2, save_steps=1, nan_policy="stop"))
    message = str(info.value)
    last_good = out / "checkpoints" / "step-2"
    assert message == f"training loss is nan or inf at steps 3-4; stopping: the last checkpoint before it is " \
                      f"{last_good} (a learning rate too high is the usual cause: try a lower --learning_rate, or " \
                      f"--nan_policy skip)"
    assert last_good.is_dir() and checkpoint.read_checkpoint(last_good)[1]["step"] == 2
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [2]

    calls["n"] = 0
    with pytest.raises(UserError, match="at steps 3-4; stopping: no checkpoint was saved before it"):
        sft.run(make_cfg(shared_data, tmp_path / "unsaved", max_steps=10, logging_steps=2, save_strategy="no"))


@pytest.mark.parametrize("trainer", ["regular", "zo"])
def test_nan_policy_skip_finishes_and_logs_strict_json(shared_data, tmp_path, monkeypatch, trainer):
    real = objective.per_example_loss
    calls = {"n": 0}

    def poisoned(model, batch, *objectives):  # the third loss call is NaN: one skipped step
        calls["n"] += 1
        loss = real(model, batch, *objectives)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(objective, "per_example_loss", poisoned)
    out = tmp_path / "run"
    results = sft.run(make_cfg(shared_data, out, trainer=trainer, max_steps=6, logging_steps=2, nan_policy="skip",
                                 zo_dual=False, learning_rate=1e-3))
    assert results["steps"] == 6 and math.isfinite(results["train_loss"])

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    lines = [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r for r in lines if "loss" in r]
    # the third call is step 3 under AdamW (one call a step), step 2 under two-pass MeZO: logging window 2 or 1
    window = 2 if trainer == "regular" else 1
    assert [r.get("skipped", 0) for r in losses] == [int(w == window) for w in (1, 2, 3)]
    assert all(math.isfinite(r["loss"]) for r in losses)


def test_huge_learning_rate_stops_with_a_one_line_error(shared_data, tmp_path):
    cfg = make_cfg(shared_data, tmp_path / "run", method="ft", learning_rate=1e30, max_steps=20, logging_steps=1)
    with pytest.raises(UserError, match=r"at step \d+") as info:
        sft.run(cfg)
    assert "\n" not in str(info.value)


def test_mezo_norm_penalty_is_weight_decay_of_twice_lambda(shared_data, tmp_path):
    """Under MeZO the penalty l(|A|^2+|B|^2) acts through its exact gradient 2l*theta, i.e. weight decay 2l."""
    common = dict(method="xgblora", trainer="zo", max_steps=6, learning_rate=5e-2, zo_eps=1e-2,
                  xgblora_steps_per_iteration=4)
    sft.run(make_cfg(shared_data, tmp_path / "pen", xgblora_norm_penalty=0.25, **common))
    sft.run(make_cfg(shared_data, tmp_path / "wd", weight_decay=0.5, xgblora_norm_penalty=0.0, **common))
    sft.run(make_cfg(shared_data, tmp_path / "none", xgblora_norm_penalty=0.0, **common))
    assert_same_tensors(adapter(tmp_path / "pen"), adapter(tmp_path / "wd"))
    assert not all(torch.equal(a, b) for a, b in zip(adapter(tmp_path / "pen").values(),
                                                      adapter(tmp_path / "none").values(), strict=True))


def test_classification_objective_on_a_generation_task_is_a_user_error(tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q: {i}?\nA:", "response": str(i)}) + "\n" for i in range(12)))
    cfg = Config(model_name="tiny-opt", task_name="custom", train_file=str(rows), num_train=8, num_eval=2,
                 trainer="regular", method="lora", max_steps=2, train_as_classification=True,
                 output_dir=str(tmp_path / "out"), result_file=str(tmp_path / "r.json"))
    with pytest.raises(UserError, match="needs answer candidates; custom is a generation task") as err:
        sft.run(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_native_bf16_warns(shared_data, tmp_path, monkeypatch, capsys, native):
    monkeypatch.setattr(perf, "cpu_has_bf16", lambda: native)
    sft.run(make_cfg(shared_data, tmp_path, bf16=True, max_steps=1, save_strategy="no", no_eval=True))
    warned = [line for line in capsys.readouterr().err.splitlines() if "no native bf16" in line]
    assert len(warned) == (0 if native else 1)
    assert not warned or "drop --bf16" in warned[0]
