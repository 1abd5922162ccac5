"""The training loop end to end on tiny-opt: learning, boosters' start, objectives, bad losses and rates."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import adapter, assert_same_tensors, make_cfg

from xgblora import checkpoint, perf
from xgblora.adapters.boosting import Boosting
from xgblora.config import Config
from xgblora.data.splits import sample_splits
from xgblora.data.tasks import get_task
from xgblora.errors import UserError
from xgblora.logs import read_metrics
from xgblora.recipes import sft
from xgblora.train import objective

# ----------------------------------------------------------------------------- learning

def test_adamw_lora_lowers_the_training_loss(glue_data, tmp_path):
    out = tmp_path / "run"
    sft.run(make_cfg(glue_data, out, max_steps=36, logging_steps=3))
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 12
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.1, losses


# ----------------------------------------------------------------------------- boosters' start

@pytest.mark.parametrize("options, started_at, orthogonal", [
    ({}, [0, 1, 2], True), (dict(xgblora_init="gradient"), [0, 1, 2], False),
    (dict(xgblora_init="gradient-orthogonal"), [0, 1, 2], True), (dict(xgblora_init="random"), [], None),
    (dict(trainer="zo"), [], None)], ids=["default", "asked", "orthogonal", "random", "zo"])
def test_gradient_init_starts_every_booster_and_only_those(glue_data, tmp_path, monkeypatch, options, started_at,
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
    sft.run(make_cfg(glue_data, tmp_path / "run", method="xgblora", max_steps=12, xgblora_steps_per_iteration=4,
                       xgblora_init_batches=1, **options))
    # boosters merged at 4 and 8 are followed by a new one; the one at 12 is not
    assert started == [(booster, orthogonal) for booster in started_at]


@pytest.mark.parametrize("init", ["gradient", "gradient-orthogonal"])
def test_zo_refuses_the_gradient_init_with_the_reason(glue_data, tmp_path, init):
    with pytest.raises(UserError, match=f"--xgblora_init {init} needs the gradient of each adapted weight"):
        make_cfg(glue_data, tmp_path / "zo", method="xgblora", trainer="zo", xgblora_init=init)


# ----------------------------------------------------------------------------- objectives

@pytest.mark.parametrize("trainer", ["regular", "zo"])
@pytest.mark.parametrize("task", ["SST2", "CB"])
def test_train_as_classification_starts_near_log_candidates(glue_data, tmp_path, trainer, task):
    cfg = make_cfg(glue_data, tmp_path / "run", task_name=task, trainer=trainer, train_as_classification=True,
                   max_steps=4, logging_steps=1, learning_rate=1e-4, no_eval=True, num_train=32)
    candidates = {len(ex.candidates) for ex in sample_splits(get_task(task, cfg.data), cfg.data).train}
    assert len(candidates) == 1
    results = sft.run(cfg)
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(math.log(candidates.pop()), abs=0.15)
    assert results["steps"] == 4 and math.isfinite(results["train_loss"])


def test_nan_loss_stops_with_a_one_line_error_naming_the_step(glue_data, tmp_path, monkeypatch):
    real = objective.per_example_loss
    calls = {"n": 0}

    def poisoned(model, batch, *objectives):
        calls["n"] += 1
        loss = real(model, batch, *objectives)
        return loss * float("nan") if calls["n"] >= 3 else loss

    monkeypatch.setattr(objective, "per_example_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(UserError) as info:  # a checkpoint every step: step-3 and step-4 were saved after the NaN
        sft.run(make_cfg(glue_data, out, max_steps=10, logging_steps=2, save_steps=1, nan_policy="stop"))
    message = str(info.value)
    last_good = out / "checkpoints" / "step-2"
    assert message == f"training loss is nan or inf at steps 3-4; stopping: the last checkpoint before it is " \
                      f"{last_good} (a learning rate too high is the usual cause: try a lower --learning_rate, or " \
                      f"--nan_policy skip)"
    assert last_good.is_dir() and checkpoint.read_checkpoint(last_good)[1]["step"] == 2
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [2]

    calls["n"] = 0
    with pytest.raises(UserError, match="at steps 3-4; stopping: no checkpoint was saved before it"):
        sft.run(make_cfg(glue_data, tmp_path / "unsaved", max_steps=10, logging_steps=2, save_strategy="no"))


@pytest.mark.parametrize("trainer", ["regular", "zo"])
def test_nan_policy_skip_finishes_and_logs_strict_json(glue_data, tmp_path, monkeypatch, trainer):
    real = objective.per_example_loss
    calls = {"n": 0}

    def poisoned(model, batch, *objectives):  # the third loss call is NaN: one skipped step
        calls["n"] += 1
        loss = real(model, batch, *objectives)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(objective, "per_example_loss", poisoned)
    out = tmp_path / "run"
    results = sft.run(make_cfg(glue_data, out, trainer=trainer, max_steps=6, logging_steps=2, nan_policy="skip",
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


def test_huge_learning_rate_stops_with_a_one_line_error(glue_data, tmp_path):
    cfg = make_cfg(glue_data, tmp_path / "run", method="ft", learning_rate=1e30, max_steps=20, logging_steps=1)
    with pytest.raises(UserError, match=r"at step \d+") as info:
        sft.run(cfg)
    assert "\n" not in str(info.value)


def test_mezo_norm_penalty_is_weight_decay_of_twice_lambda(glue_data, tmp_path):
    """Under MeZO the penalty l(|A|^2+|B|^2) acts through its exact gradient 2l*theta, i.e. weight decay 2l."""
    common = dict(method="xgblora", trainer="zo", max_steps=6, learning_rate=5e-2, zo_eps=1e-2,
                  xgblora_steps_per_iteration=4)
    sft.run(make_cfg(glue_data, tmp_path / "pen", xgblora_norm_penalty=0.25, **common))
    sft.run(make_cfg(glue_data, tmp_path / "wd", weight_decay=0.5, xgblora_norm_penalty=0.0, **common))
    sft.run(make_cfg(glue_data, tmp_path / "none", xgblora_norm_penalty=0.0, **common))
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
def test_bf16_on_a_cpu_without_native_bf16_warns(glue_data, tmp_path, monkeypatch, capsys, native):
    monkeypatch.setattr(perf, "cpu_has_bf16", lambda: native)
    sft.run(make_cfg(glue_data, tmp_path, bf16=True, max_steps=1, save_strategy="no", no_eval=True))
    warned = [line for line in capsys.readouterr().err.splitlines() if "no native bf16" in line]
    assert len(warned) == (0 if native else 1)
    assert not warned or "drop --bf16" in warned[0]
