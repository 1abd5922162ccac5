"""Atomic, verified checkpoints: save failures, damaged files, RNG capture and pruning."""

import errno
import logging
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from xgblora import checkpoint
from xgblora.errors import UserError


def test_save_load_round_trip_and_rng(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = checkpoint.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    tensors = {"a.lora_A": torch.randn(2, 3), "b": torch.arange(4)}
    path = checkpoint.save(tmp_path, "step-5", tensors, {"step": 5, "rng": state}, {"optimizer": {"x": torch.ones(2)}})
    got, loaded_state, blobs = checkpoint.read_checkpoint(path)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert torch.equal(blobs["optimizer"]["x"], torch.ones(2))
    checkpoint.set_rng_state(loaded_state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def fail_with(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc

    return fail


# how each writer reports a full disk (seen on a 64 KiB tmpfs): Python's own writes, safetensors, torch.save
FAILED_WRITES = {
    "oserror-enospc": ("save_file", OSError(errno.ENOSPC, "No space left on device")),
    "safetensors": ("save_file", SafetensorError("Error while serializing: I/O error: No space left on device")),
    "torch-save": ("torch.save", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576")),
}


@pytest.mark.parametrize("case", list(FAILED_WRITES))
def test_failed_save_keeps_earlier_checkpoints_removes_its_folder_and_says_the_space_needed(tmp_path, monkeypatch,
                                                                                          case):
    checkpoint.save(tmp_path, "step-1", {"w": torch.zeros(2)}, {"step": 1})
    writer, exc = FAILED_WRITES[case]
    if writer == "torch.save":
        monkeypatch.setattr(checkpoint.torch, "save", fail_with(exc))
    else:
        monkeypatch.setattr(checkpoint, "save_file", fail_with(exc))
    weights = torch.ones(1000)  # 4,000 bytes; the optimizer state (blobs) as many again
    with pytest.raises(UserError) as info:
        checkpoint.save(tmp_path, "step-2", {"w": weights}, {"step": 2}, {"stepper": {"m": torch.ones(1000)}})
    message = str(info.value)
    assert "\n" not in message and "step-2" in message and str(exc) in message
    assert "needs about 8,000 bytes" in message and "are free on that disk" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # no .step-2.tmp left behind
    assert checkpoint.load_requested(tmp_path, "latest")[0].name == "step-1"
    assert torch.equal(checkpoint.read_checkpoint(tmp_path / "step-1")[0]["w"], torch.zeros(2))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def flip(path: Path) -> None:
    """Change one bit in the middle of the file (a bad sector, a bad copy): same size, other bytes."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": (truncate, "has {n} bytes, {m} were written"),
          "flipped": (flip, "does not match its SHA-256"),
          "deleted": (Path.unlink, "is missing")}


@pytest.mark.parametrize("file", [checkpoint.WEIGHTS, checkpoint.BLOBS, checkpoint.STATE])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_and_latest_falls_back_with_a_warning(tmp_path, xgblora_log, damage, file):
    for step in (1, 2):
        checkpoint.save(tmp_path, f"step-{step}", {"w": torch.full((64,), float(step))}, {"step": step},
                        {"stepper": {"m": torch.ones(64)}})
    target = tmp_path / "step-2" / file
    size = target.stat().st_size
    do, what = DAMAGE[damage]
    do(target)
    expected = what.format(n=size - 7, m=size)
    with pytest.raises(checkpoint.DamagedCheckpoint, match=re.escape(f"{file} {expected}")):
        checkpoint.read_checkpoint(tmp_path / "step-2")
    path, (tensors, state, _) = checkpoint.load_requested(tmp_path, "latest")
    assert path.name == "step-1" and state["step"] == 1 and torch.equal(tensors["w"], torch.ones(64))
    warnings = [r.getMessage() for r in xgblora_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "step-2") in warnings[0] and file in warnings[0], warnings


def test_checkpoint_without_manifest_or_all_damaged_is_a_user_error(tmp_path):
    checkpoint.save(tmp_path, "step-1", {"w": torch.zeros(2)}, {"step": 1})
    (tmp_path / "step-1" / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.DamagedCheckpoint, match="no manifest.json"):
        checkpoint.read_checkpoint(tmp_path / "step-1")
    with pytest.raises(UserError, match="every checkpoint under .* is damaged \\(step-1\\)"):
        checkpoint.load_requested(tmp_path, "latest")


def test_resave_same_name_replaces_whole(tmp_path):
    checkpoint.save(tmp_path, "best", {"w": torch.zeros(2)}, {"step": 1})
    checkpoint.save(tmp_path, "best", {"w": torch.ones(2)}, {"step": 2})
    tensors, state, _ = checkpoint.read_checkpoint(tmp_path / "best")
    assert state["step"] == 2 and torch.equal(tensors["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_prune_keeps_newest_and_latest_needs_one(tmp_path):
    with pytest.raises(UserError, match="no checkpoint under"):
        checkpoint.load_requested(tmp_path, "latest")
    for step in (10, 2, 30):
        checkpoint.save(tmp_path, f"step-{step}", {"w": torch.zeros(1)}, {"step": step})
    checkpoint.prune(tmp_path, 2)
    assert [p.name for p in checkpoint.step_checkpoints(tmp_path)] == ["step-10", "step-30"]
    with pytest.raises(UserError, match="not a checkpoint"):
        checkpoint.read_checkpoint(tmp_path)
