"""benchmarks/rank_regime.py end to end at toy size: the grid at the first seed, the choice on dev loss, equal
parameters for LoRA r=1 and XGBLoRA, the table, and finished runs reused only under the same protocol."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark

from xgblora.adapters.peft import write_peft


@pytest.mark.slow
def test_toy_rank_regime_chooses_on_dev_and_reuses_runs(tmp_path, glue_data):
    bench = load_benchmark("rank_regime")
    runs = ["LoRA r=1 (AdamW)", "XGBLoRA r=1, plain, 25 boosters (AdamW)"]
    bench.RUNS[runs[0]] = (bench.RUNS[runs[0]][0], (1e-2, 1e-1))  # two grid points: CI time
    bench.RUNS[runs[1]] = (bench.RUNS[runs[1]][0], (1e-2,))
    argv = ["--data_dir", str(glue_data), "--num_train", "16", "--num_dev", "8", "--num_eval", "8", "--steps", "25",
            "--batch_size", "4", "--seeds", "0", "1", "--out", str(tmp_path), "--runs", *runs]
    text = bench.main(argv)
    saved = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    lora = [r for r in saved if r["run"] == runs[0]]
    assert sorted((r["seed"], r["lr"]) for r in lora if r["seed"] == 0) == [(0, 1e-2), (0, 1e-1)]
    chosen = min((r for r in lora if r["seed"] == 0), key=lambda r: r["dev_loss"])["lr"]
    assert [r["lr"] for r in lora if r["seed"] == 1] == [chosen]  # the other seeds run the dev choice only
    assert f"| {runs[0]} | {chosen:g} |" in text and f"| {runs[1]} | 0.01 |" in text
    xgb = [r for r in saved if r["run"] == runs[1]]
    assert {r["trainable_params"] for r in xgb} == {lora[0]["trainable_params"]}  # equal parameters, rank 1
    assert all(r["config"]["max_steps"] == 25 for r in saved)

    mtimes = {p: p.stat().st_mtime for p in tmp_path.glob("*.json")}
    assert bench.main(argv).split("\n\n")[0] == text.split("\n\n")[0]
    assert {p: p.stat().st_mtime for p in tmp_path.glob("*.json")} == mtimes  # finished runs are reused
    bench.PROTOCOL_VERSION += 1
    bench.main([*argv[:-2], runs[1]])
    assert all(p.stat().st_mtime > mtimes[p] for p in tmp_path.glob("xgblora*.json"))  # a new protocol runs again


def test_adapter_geometry_against_updates_of_known_rank(tmp_path):
    """Effective rank: k for k orthogonal rank-1 terms of equal size, exp(entropy) of (2, 1, 1)/4 for unequal ones,
    1 for one direction taken k times, whose A rows then have |cos| 1 (orthogonal rows: 0)."""
    bench = load_benchmark("rank_regime")
    eye = torch.eye(6)

    def geometry(A: torch.Tensor, B: torch.Tensor) -> dict[str, float]:
        write_peft({"q": (A, B, len(A), float(len(A)))}, tmp_path, "tiny-llama")  # scaling 1, as boosters are saved
        return bench.adapter_geometry(tmp_path)

    got = geometry(eye[:4], eye[:, :4])  # 4 orthogonal unit terms
    assert got["effective_rank"] == pytest.approx(4.0) and got["a_cosine"] == pytest.approx(0.0, abs=1e-12)
    p = torch.tensor([0.5, 0.25, 0.25])
    got = geometry(eye[:3], eye[:, :3] * torch.tensor([2.0, 1.0, 1.0]))
    assert got["effective_rank"] == pytest.approx(float(torch.exp(-(p * p.log()).sum())))
    same = eye[:1].repeat(3, 1) * torch.tensor([[1.0], [-2.0], [0.5]])  # one direction, three boosters
    got = geometry(same, torch.randn(6, 3))
    assert got["effective_rank"] == pytest.approx(1.0) and got["a_cosine"] == pytest.approx(1.0)
    assert bench.adapter_geometry(tmp_path / "none") == {}  # a full fine-tune writes no adapter
