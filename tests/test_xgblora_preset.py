"""XGBLoRA's presets: plain (the default: 25 boosters of at least 50 steps on every layer, no penalty) and paper
(5 boosters, each on a third of the layers, the norm penalty), alpha_t = 1, T boosters over the run, a warning when
the user's flags leave nothing to merge, and the per-booster learning-rate restart."""

from __future__ import annotations

import pytest
import torch
from helpers import make_cfg, records

from xgblora.adapters.boosting import block_of
from xgblora.config import Config
from xgblora.distributed import LOCAL
from xgblora.models import pretrained
from xgblora.recipes import sft
from xgblora.train.loop import build_stepper
from xgblora.train.objective import TrainingLoss
from xgblora.train.setup import setup_method


def _six_layer_method(**overrides):
    model, _ = pretrained.random_model("tiny-bert", head="classifier", num_hidden_layers=6, num_labels=2)
    cfg = Config(**{"method": "xgblora", "trainer": "regular", **overrides})
    return model, cfg, setup_method(model, cfg)


def test_the_default_is_the_plain_preset_with_25_boosters_of_at_least_50_steps():
    _, cfg, method = _six_layer_method()
    assert (cfg.xgblora_preset, cfg.norm_penalty) == ("plain", 0.0)
    # 25 boosters where the run is long enough (max_steps >= 25 x 50), else as many of at least 50 steps as fit
    assert {n: cfg.booster_steps(n) for n in (10, 80, 100, 400, 1250, 5000)} == {
        10: 10, 80: 80, 100: 50, 400: 50, 1250: 50, 5000: 200}
    assert method.boosting.layers_per_booster == 6
    paper = Config(method="xgblora", xgblora_preset="paper")
    assert (paper.norm_penalty, paper.booster_steps(100)) == (1e-3, 20)
    assert Config(method="xgblora", xgblora_num_boosters=10).booster_steps(100) == 10  # explicit flags win
    assert Config(method="xgblora", xgblora_steps_per_iteration=3).booster_steps(100) == 3


def test_paper_preset_puts_each_booster_on_a_random_third_of_the_layers():
    _, _, method = _six_layer_method(xgblora_preset="paper")
    boosting = method.boosting
    active = {block_of(name) for name in boosting.active_modules()}
    assert boosting.layers_per_booster == 2 and len(active) == 2
    assert all(m.lora_A.requires_grad == m.active for m in method.modules.values())
    boosting.plan(1, 100)
    subsets = set()
    for step in range(1, 9):  # each merge draws the next booster's layers
        boosting.after_step(step, None)
        subsets.add(tuple(boosting.subset))
    assert len(subsets) > 1
    assert _six_layer_method(xgblora_layers_per_booster=4)[2].boosting.layers_per_booster == 4


def test_paper_preset_adds_the_norm_penalty_and_merges_with_alpha_t_one():
    model, cfg, method = _six_layer_method(xgblora_preset="paper")
    assert (cfg.norm_penalty, cfg.xgblora_shrinkage) == (1e-3, 1.0)
    assert Config(method="xgblora", xgblora_preset="plain").norm_penalty == 0.0
    assert Config(method="lora").norm_penalty == 0.0
    for m in method.modules.values():
        torch.nn.init.normal_(m.lora_B)
    stepper = build_stepper(cfg, method, TrainingLoss(model), LOCAL, torch.device("cpu"))
    by_hand = 1e-3 * sum(m.lora_A.square().sum() + m.lora_B.square().sum()
                         for m in method.modules.values() if m.active)
    torch.testing.assert_close(stepper.penalty(), by_hand)
    zo = build_stepper(Config(method="xgblora", xgblora_preset="paper", trainer="zo"), method, TrainingLoss(model), LOCAL,
                       torch.device("cpu"))
    assert zo.mezo.weight_decay == pytest.approx(2e-3)  # d/dtheta of l |theta|^2
    adam = build_stepper(Config(method="xgblora", xgblora_preset="paper", trainer="zo", zo_optimizer="adam"), method,
                         TrainingLoss(model), LOCAL, torch.device("cpu"))
    # ZO-Adam: the penalty's gradient goes with the estimate into Adam's moments, as under AdamW, not into the
    # decoupled decay
    assert adam.mezo.weight_decay == 0.0 and adam.mezo._grad_penalty == pytest.approx(2e-3)


def test_num_boosters_splits_the_run_and_the_schedule_can_restart_per_booster(glue_data, tmp_path):
    cfg = make_cfg(glue_data, tmp_path / "run", method="xgblora", max_steps=12, xgblora_num_boosters=3,
                   lr_scheduler_type="linear", xgblora_restart_schedule=True, logging_steps=1, save_strategy="no")
    result = sft.run(cfg)
    log = records(tmp_path / "run")
    assert [r["step"] for r in log if r.get("event") == "merge"] == [4, 8, 12] and result["boosters"] == 3
    lrs = [r["lr"] for r in log if "lr" in r]
    assert lrs == pytest.approx([cfg.learning_rate * f for f in (1, 0.75, 0.5, 0.25)] * 3)


def test_a_run_that_would_merge_fewer_than_two_boosters_says_so(glue_data, tmp_path, caplog):
    with caplog.at_level("INFO", logger="xgblora"):  # the default's one booster in a short run: said, not warned
        sft.run(make_cfg(glue_data, tmp_path / "a", method="xgblora", max_steps=6, save_strategy="no"))
    said = [r for r in caplog.records if "this run is rank-1 LoRA" in r.getMessage()]
    assert [(r.levelname, r.getMessage()[:55]) for r in said] == [
        ("INFO", "XGBLoRA: 6 steps at 6 steps per booster merge 1 booster")]
    caplog.clear()
    with caplog.at_level("WARNING", logger="xgblora"):
        sft.run(make_cfg(glue_data, tmp_path / "b", method="xgblora", max_steps=6, save_strategy="no",
                           xgblora_steps_per_iteration=10))
    assert "6 steps at 10 steps per booster merge 0 booster(s): this run is rank-1 LoRA" in caplog.text
