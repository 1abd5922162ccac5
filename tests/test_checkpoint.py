"""Atomic checkpoints, RNG capture and pruning."""

import random

import numpy as np
import pytest
import torch

from xgblora.errors import UserError
from xgblora.train import checkpoint


def test_save_load_round_trip_and_rng(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = checkpoint.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    tensors = {"a.lora_A": torch.randn(2, 3), "b": torch.arange(4)}
    path = checkpoint.save(tmp_path, "step-5", tensors, {"step": 5, "rng": state}, {"optimizer": {"x": torch.ones(2)}})
    got, loaded_state, blobs = checkpoint.load(path)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert torch.equal(blobs["optimizer"]["x"], torch.ones(2))
    checkpoint.set_rng_state(loaded_state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, "step-1", {"w": torch.zeros(2)}, {"step": 1})

    def crash(*args, **kwargs):
        raise OSError("disk died mid-save")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, "step-2", {"w": torch.ones(2)}, {"step": 2})
    assert [p.name for p in checkpoint.step_checkpoints(tmp_path)] == ["step-1"]
    assert checkpoint.resolve(tmp_path, "latest").name == "step-1"
    assert torch.equal(checkpoint.load(tmp_path / "step-1")[0]["w"], torch.zeros(2))


def test_resave_same_name_replaces_whole(tmp_path):
    checkpoint.save(tmp_path, "best", {"w": torch.zeros(2)}, {"step": 1})
    checkpoint.save(tmp_path, "best", {"w": torch.ones(2)}, {"step": 2})
    tensors, state, _ = checkpoint.load(tmp_path / "best")
    assert state["step"] == 2 and torch.equal(tensors["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_prune_keeps_newest_and_latest_needs_one(tmp_path):
    with pytest.raises(UserError, match="no checkpoint under"):
        checkpoint.resolve(tmp_path, "latest")
    for step in (10, 2, 30):
        checkpoint.save(tmp_path, f"step-{step}", {"w": torch.zeros(1)}, {"step": step})
    checkpoint.prune(tmp_path, 2)
    assert [p.name for p in checkpoint.step_checkpoints(tmp_path)] == ["step-10", "step-30"]
    with pytest.raises(UserError, match="not a checkpoint"):
        checkpoint.load(tmp_path)
