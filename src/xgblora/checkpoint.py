"""Checkpoints: the one module that knows their layout. Written atomically (temporary folder, fsync, rename) and
verified when loaded.

A checkpoint folder holds `trainable.safetensors` (the trainable weights, plus the merged-into base weights of
adapted layers under XGBLoRA), `trainer_state.json` (the loop state and the RNG states), `state.pt` (each
component's `state_dict()` under its name: the stepper's optimizer state, the booster history), for adapter
runs `adapter/` (the model at that step as a PEFT LoRA adapter, what `xgblora export --checkpoint` and the model
loaders read) and `manifest.json` (the size and SHA-256 of each of those files). `Checkpointer` saves and restores a run's
components side by side; the functions above it are the file operations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from xgblora import atomic
from xgblora.errors import UserError

WEIGHTS, BLOBS, STATE, MANIFEST = "trainable.safetensors", "state.pt", "trainer_state.json", "manifest.json"
ADAPTER = "adapter"
_STEP_DIR = re.compile(r"^step-(\d+)$")
log = logging.getLogger("xgblora")
# what a checkpoint holds: (trainable tensors, loop state, component state_dicts)
Contents = tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]


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


def save(root: Path, name: str, tensors: dict[str, torch.Tensor], state: dict[str, Any],
         blobs: dict[str, Any] | None = None, write_adapter: Callable[[Path], None] | None = None) -> Path:
    """Write root/name whole, with a manifest of its files: a kill at any moment leaves the old checkpoint or the
    new one. A failed write (a full disk, an I/O error) removes the partial folder and raises a one-line UserError
    that says how much space the checkpoint needs."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    path = root / name
    root.mkdir(parents=True, exist_ok=True)
    try:
        with atomic.replaced_folder(path) as tmp:
            save_file(tensors, str(tmp / WEIGHTS))
            if blobs is not None:
                torch.save(blobs, tmp / BLOBS)
            (tmp / STATE).write_text(json.dumps(state), encoding="utf-8")
            if write_adapter is not None:
                write_adapter(tmp / ADAPTER)
            write_manifest(tmp)
    # the writers report a failed write in their own way: safetensors as SafetensorError, torch.save as
    # RuntimeError ("unexpected pos"), Python as OSError (all three seen on a full disk)
    except (OSError, SafetensorError, RuntimeError) as exc:
        raise _save_failed(path, exc, _nbytes(tensors) + _nbytes(blobs)) from None
    return path


def _nbytes(value: Any) -> int:
    """The bytes of the tensors in a nested dict/list (what a checkpoint file of them needs, give or take)."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _save_failed(path: Path, exc: BaseException, needed: int) -> UserError:
    return atomic.failed_write(path, exc, needed, "The earlier checkpoints are intact: free some space (or lower "
                               "--save_total_limit), then resume with --resume_from_checkpoint latest",
                               what="save checkpoint")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record the size and SHA-256 of every file in folder. SHA-256 reads about 1 GB/s: a fifth more time on a
    save, most of a resume's load (BENCHMARKS.md); chosen over CRC-32 so that `sha256sum` can check it too."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


class DamagedCheckpoint(UserError):
    """A checkpoint whose files are missing, cut short or changed since they were written."""


def verify(path: Path) -> None:
    """Check every file of the checkpoint against its manifest; DamagedCheckpoint names the first that differs."""
    if not (path / MANIFEST).is_file():
        raise DamagedCheckpoint(f"{path}: damaged checkpoint: no {MANIFEST} (copied in part, or saved by an "
                                f"xgblora that wrote none)")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(f"{path}: damaged checkpoint: cannot read its {MANIFEST} "
                                f"({exc.__class__.__name__})") from None
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise DamagedCheckpoint(f"{path}: damaged checkpoint: {name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise DamagedCheckpoint(f"{path}: damaged checkpoint: {name} has {size} bytes, {expected['bytes']} "
                                    f"were written")
        if _sha256(file) != expected["sha256"]:
            raise DamagedCheckpoint(f"{path}: damaged checkpoint: {name} does not match its SHA-256 (changed "
                                    f"after it was written)")


def read_checkpoint(path: Path) -> Contents:
    """Verify and read a checkpoint: (tensors, loop state, blobs); blobs load with weights_only=True (no pickle
    of code)."""
    if not any((path / name).is_file() for name in (MANIFEST, WEIGHTS, STATE)):
        raise UserError(f"{path}: not a checkpoint (expected {WEIGHTS}, {STATE} and {MANIFEST})")
    verify(path)
    blobs = torch.load(path / BLOBS, weights_only=True) if (path / BLOBS).is_file() else {}
    return load_file(str(path / WEIGHTS)), json.loads((path / STATE).read_text(encoding="utf-8")), blobs


def step_checkpoints(root: Path) -> list[Path]:
    """The step-N checkpoints under root, oldest first (interrupted .tmp folders are ignored)."""
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def clear(root: Path) -> None:
    """Remove every checkpoint under root (step-N, best, and folders a killed save left): a run started over must
    not leave an earlier run's checkpoints for 'latest' to find."""
    for path in root.glob("*"):
        if path.is_dir() and (_STEP_DIR.match(path.name) or path.name == "best" or path.name.endswith((".tmp", ".old"))):
            shutil.rmtree(path)


def load_requested(root: Path, requested: str) -> tuple[Path, Contents]:
    """Load the given folder, or for 'latest' the newest intact step checkpoint under root (warning about each
    damaged one passed over); returns its path and what read_checkpoint() read."""
    if requested != "latest":
        return Path(requested), read_checkpoint(Path(requested))
    found = step_checkpoints(root)
    if not found:
        raise UserError(f"--resume_from_checkpoint latest: no checkpoint under {root}")
    for path in reversed(found):
        try:
            return path, read_checkpoint(path)
        except DamagedCheckpoint as exc:
            log.warning("%s; resuming from an earlier checkpoint", exc)
    raise UserError(f"--resume_from_checkpoint latest: every checkpoint under {root} is damaged "
                    f"({', '.join(p.name for p in found)}); see the warnings above")


def find(root: Path, spec: str) -> Path:
    """A verified checkpoint folder under root by name: step-N, best, or latest (the newest intact step-N)."""
    if spec == "latest":
        return load_requested(root, "latest")[0]
    if spec != "best" and not _STEP_DIR.match(spec):
        raise UserError(f"--checkpoint {spec!r}: give step-N, latest or best")
    path = root / spec
    if not path.is_dir():
        have = ", ".join(p.name for p in [*step_checkpoints(root), root / "best"] if p.is_dir()) or "none"
        raise UserError(f"--checkpoint {spec}: no such checkpoint under {root} (there: {have})")
    verify(path)
    return path


def adapter_folder(path: Path) -> Path:
    """The PEFT adapter a checkpoint holds; a one-line error for a full fine-tuning checkpoint (no adapter) or one
    written before checkpoints held adapters."""
    folder = path / ADAPTER
    if not (folder / "adapter_config.json").is_file():
        raise UserError(f"{path}: this checkpoint holds no PEFT adapter (a full fine-tuning run's, or written by an "
                        f"xgblora before checkpoints held one)")
    return folder


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
                 save_only_model: bool = False, is_main: bool = True,
                 write_adapter: Callable[[Path], None] | None = None):
        self.root, self.model, self.tensors, self.write_adapter = root, model, tensors, write_adapter
        self.components = {} if save_only_model else components
        self.model_components = model_components
        self.is_main = is_main

    def save(self, name: str, loop_state: dict[str, Any]) -> Path:
        """Write root/name (every rank calls it: gathering sharded weights, or a component's per-rank state, needs
        them all)."""
        tensors = self.tensors()
        blobs = {key: c.state_dict() for key, c in {**self.components, **self.model_components}.items()}
        if not self.is_main:
            return self.root / name
        return save(self.root, name, tensors, {**loop_state, "rng": rng_state()}, blobs, self.write_adapter)

    def restore(self, requested: str) -> tuple[Path, dict[str, Any]]:
        """Load a checkpoint ('latest' or a folder) into the model, the RNGs and the components; return its path
        and the loop state."""
        path, (tensors, state, blobs) = load_requested(self.root, requested)
        self._into_model(tensors, blobs)
        set_rng_state(state.pop("rng"))
        for key, component in self.components.items():
            if key in blobs:  # absent when the checkpoint was saved with save_only_model
                component.load_state_dict(blobs[key])
        return path, state

    def load_weights(self, path: Path) -> dict[str, Any]:
        """Load a checkpoint's weights and model components (not the stepper); return its loop state."""
        tensors, state, blobs = read_checkpoint(path)
        self._into_model(tensors, blobs)
        return state

    def _into_model(self, tensors: dict[str, torch.Tensor], blobs: dict[str, Any]) -> None:
        self.model.load_state_dict(tensors, strict=False)
        for key, component in self.model_components.items():
            component.load_state_dict(blobs[key])


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as a dict; UserError when it is missing or names no model."""
    cfg_path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    if not cfg_path.is_file():
        raise UserError(f"{run_dir}: not a run folder (no config.yaml)")
    try:
        cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{cfg_path}: cannot read ({exc.__class__.__name__})") from None
    if not isinstance(cfg, dict) or not cfg.get("model_name"):
        raise UserError(f"{cfg_path}: no model_name")
    return cfg
