"""Checkpoints written atomically (temporary folder, fsync, rename): weights, optimizer blobs, loop state, RNG states."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from xgblora.errors import UserError

WEIGHTS, BLOBS, STATE = "trainable.safetensors", "state.pt", "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states, as JSON-serialisable values."""
    np_state = np.random.get_state()
    state = {"python": _to_json(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states captured by rng_state()."""
    random.setstate(_to_tuple(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _to_json(value: Any) -> Any:
    return [_to_json(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, list) else value


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, name: str, tensors: dict[str, torch.Tensor], state: dict[str, Any],
         blobs: dict[str, Any] | None = None) -> Path:
    """Write root/name atomically: a kill at any moment leaves either the old checkpoint or the new one, whole."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / name, root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / WEIGHTS))
    if blobs is not None:
        torch.save(blobs, tmp / BLOBS)
    (tmp / STATE).write_text(json.dumps(state), encoding="utf-8")
    for f in tmp.iterdir():
        with open(f, "rb+") as handle:
            os.fsync(handle.fileno())
    old = root / f".{name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Read a checkpoint: (tensors, loop state, blobs); blobs load with weights_only=True (no pickle of code)."""
    if not (path / STATE).is_file() or not (path / WEIGHTS).is_file():
        raise UserError(f"{path}: not a checkpoint (expected {WEIGHTS} and {STATE})")
    blobs = torch.load(path / BLOBS, weights_only=True) if (path / BLOBS).is_file() else {}
    return load_file(str(path / WEIGHTS)), json.loads((path / STATE).read_text(encoding="utf-8")), blobs


def step_checkpoints(root: Path) -> list[Path]:
    """The step-N checkpoints under root, oldest first (interrupted .tmp folders are ignored)."""
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve(root: Path, requested: str) -> Path:
    """'latest' -> the newest step checkpoint under root; otherwise the given folder."""
    if requested != "latest":
        return Path(requested)
    found = step_checkpoints(root)
    if not found:
        raise UserError(f"--resume_from_checkpoint latest: no checkpoint under {root}")
    return found[-1]


def prune(root: Path, keep: int | None) -> None:
    """Delete the oldest step checkpoints beyond `keep` (None keeps all)."""
    if keep is None:
        return
    found = step_checkpoints(root)
    for path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
