"""Checkpoints: the one module that knows their layout. Written atomically (temporary folder, fsync, rename).

A checkpoint folder holds `trainable.safetensors` (the trainable weights, plus the merged-into base weights of
adapted layers under XGBLoRA), `trainer_state.json` (the loop state and the RNG states) and `state.pt` (each
component's `state_dict()` under its name: the stepper's optimizer state, the booster history). `Checkpointer`
saves and restores a run's components side by side; the functions below it are the atomic file operations.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

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


class Stateful(Protocol):
    """A component that saves and restores itself."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Save and restore a run: the model's trainable tensors, the loop state, the RNG states, and named components.

    `model_components` are part of the model (the XGBLoRA booster history: final/ exports it) and are saved even
    with save_only_model; `components` (the stepper) only without it. Only the main process writes.
    """

    def __init__(self, root: Path, *, model: torch.nn.Module, tensors: Callable[[], dict[str, torch.Tensor]],
                 components: dict[str, Stateful], model_components: dict[str, Stateful],
                 save_only_model: bool = False, is_main: bool = True):
        self.root, self.model, self.tensors = root, model, tensors
        self.components = {} if save_only_model else components
        self.model_components = model_components
        self.is_main = is_main

    def save(self, name: str, loop_state: dict[str, Any]) -> Path:
        """Write root/name (every rank calls it: gathering sharded weights needs them all)."""
        tensors = self.tensors()
        if not self.is_main:
            return self.root / name
        blobs = {key: c.state_dict() for key, c in {**self.components, **self.model_components}.items()}
        return save(self.root, name, tensors, {**loop_state, "rng": rng_state()}, blobs)

    def restore(self, requested: str) -> tuple[Path, dict[str, Any]]:
        """Load a checkpoint ('latest' or a folder) into the model, the RNGs and the components; return its path
        and the loop state."""
        path = resolve(self.root, requested)
        state, blobs = self._load_into_model(path)
        set_rng_state(state.pop("rng"))
        for key, component in self.components.items():
            if key in blobs:  # absent when the checkpoint was saved with save_only_model
                component.load_state_dict(blobs[key])
        return path, state

    def load_model(self, path: Path) -> dict[str, Any]:
        """Load a checkpoint's weights and model components (not the stepper); return its loop state."""
        return self._load_into_model(path)[0]

    def _load_into_model(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors, state, blobs = load(path)
        self.model.load_state_dict(tensors, strict=False)
        for key, component in self.model_components.items():
            component.load_state_dict(blobs[key])
        return state, blobs
