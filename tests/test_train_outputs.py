"""What a training run writes: metrics, results, config.yaml, the result copy, checkpoints kept, the best model."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import adapter, make_cfg

from xgblora import checkpoint, parsing
from xgblora.config import Config
from xgblora.errors import UserError
from xgblora.logs import read_metrics
from xgblora.recipes import sft
from xgblora.train import results as results_mod

# ----------------------------------------------------------------------------- outputs

def test_metrics_results_and_config_of_a_run(glue_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(glue_data, out, method="xgblora", xgblora_steps_per_iteration=3, max_steps=8, logging_steps=2,
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


def test_result_copy_only_when_asked_and_never_over_another_runs_file(glue_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft.run(make_cfg(glue_data, tmp_path / "plain", trainer="zo", max_steps=1, result_file=None))
    assert not (tmp_path / "result").exists()  # nothing lands in the working directory unasked

    cfg = make_cfg(glue_data, tmp_path / "run", trainer="zo", max_steps=2, result_file="auto", num_dev=8)
    expected = tmp_path / "result" / f"{results_mod.result_file_tag(cfg)}-trainset0.json"
    assert expected.name == "SST2-tiny-opt-sampleeval16-ntrain64-ndev8-trainset0.json"
    expected.parent.mkdir()
    expected.write_text("a user's file")
    sft.run(cfg)
    assert expected.read_text() == "a user's file"
    second = expected.with_name(expected.stem + "-2.json")
    assert json.loads(second.read_text()) == json.loads((tmp_path / "run" / "results.json").read_text())


@pytest.mark.parametrize("flags", [dict(load_best_model_at_end=True), dict(evaluation_strategy="steps", eval_steps=1)])
def test_choosing_on_dev_needs_a_dev_split(glue_data, tmp_path, flags):
    with pytest.raises(UserError, match=r"needs a dev split.*pass --num_dev N"):
        sft.run(make_cfg(glue_data, tmp_path / "run", max_steps=2, num_dev=None, **flags))


def test_save_total_limit_and_load_best_model_at_end(glue_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(glue_data, out, max_steps=12, save_steps=2, save_total_limit=2, evaluation_strategy="steps",
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


def test_load_best_model_at_end_with_xgblora_exports_the_best_model(glue_data, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(glue_data, out, method="xgblora", xgblora_steps_per_iteration=2, max_steps=8, save_strategy="no",
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


