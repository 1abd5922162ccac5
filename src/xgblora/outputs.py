"""Whose files an output folder holds, checked before a command writes into it (and before any model loads).

A run writes config.yaml, metrics.jsonl, results.json, predictions.jsonl, final/ ... under fixed names, so it may
only write into a folder that is new, empty, or an earlier xgblora run's: one holding results.json, checkpoints/,
xgblora.lock or a config.yaml that a run wrote. A folder of other files (the working directory, a data folder) is
refused, and so is a config.yaml that a run did not write (the very file passed with --config, say). Kept free of
heavy imports: the CLI calls it while it checks the flags.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import yaml

from xgblora.errors import UserError

LOCK_NAME = "xgblora.lock"
CONFIG_NAME = "config.yaml"
# The first line of every config.yaml a run writes: what marks the file as the run's own, to rewrite on a resume.
CONFIG_HEADER = "# Written by xgblora: the resolved options of the run in this folder (--config FILE repeats it)"
RUN_MARKERS = ("results.json", "checkpoints", LOCK_NAME)
# Keys that every config.yaml a run wrote before CONFIG_HEADER holds (a run writes every option of its command);
# a config file a person writes names a few options, rarely all of these.
_DUMPED_KEYS = frozenset({"model_name", "output_dir", "overwrite_output_dir", "seed", "learning_rate", "max_steps",
                          "save_strategy", "logging_steps", "resume_from_checkpoint"})


def _is_temporary(name: str) -> bool:
    """An xgblora temporary (`.NAME.tmp`, `.NAME.old`, the writability probe): ours, whole or not."""
    return name.startswith(".") and name.endswith((".tmp", ".old"))


def _has_header(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().rstrip("\n") == CONFIG_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def is_run_config(path: Path) -> bool:
    """Whether a config.yaml was written by a run: it starts with CONFIG_HEADER, or (written before the header was)
    it holds every option a run has always written."""
    if _has_header(path):
        return True
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and _DUMPED_KEYS.issubset(data)


def holds_run(folder: Path) -> bool:
    """Whether a folder holds an xgblora run (finished, interrupted, failed or running)."""
    folder = Path(folder)
    return any((folder / name).exists() for name in RUN_MARKERS) or is_run_config(folder / CONFIG_NAME)


def _user_files(folder: Path) -> list[str]:
    """The names in a folder, less xgblora's own temporaries (sorted, for the message)."""
    try:
        return sorted(name for name in os.listdir(folder) if not _is_temporary(name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _named(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_folder(folder: Path, flag: str, ours: Callable[[Path], bool], what: str) -> None:
    """Refuse a folder that holds files but nothing `ours` recognises as an earlier output of this command: the
    command would write its outputs in among them, over any that share a name."""
    names = _user_files(folder)
    if names and not ours(Path(folder)):
        raise UserError(f"{flag} {folder}: the folder holds files that are not {what} ({_named(names)}); xgblora "
                        f"never writes among your files: choose a new or empty folder")


def check_run_folder(folder: Path, flag: str = "--output_dir") -> None:
    """Refuse a run's output folder that holds someone else's files, or a config.yaml that no run wrote (the run
    writes its own config.yaml there)."""
    folder = Path(folder)
    check_folder(folder, flag, holds_run, "an xgblora run's")
    config = folder / CONFIG_NAME
    if config.exists() and not is_run_config(config):
        raise UserError(f"{flag} {folder}: its {CONFIG_NAME} was not written by xgblora, and the run would write "
                        f"its own there; move the file, or choose another folder")


def check_config_file(folder: Path, config_file: str) -> None:
    """Refuse a --config FILE that is the run's own FOLDER/config.yaml, which the run rewrites, unless it is a run's
    config.yaml in its run's folder (repeating or resuming that run)."""
    config = Path(folder) / CONFIG_NAME
    try:
        same = config.exists() and config.samefile(config_file)
    except OSError:
        return
    if same and not (_has_header(config) or any((Path(folder) / name).exists() for name in RUN_MARKERS)):
        raise UserError(f"--config {config_file}: the run writes its resolved options to {config}, which is this "
                        f"file; choose another --output_dir (or keep the file elsewhere)")


def holds_runs(root: Path) -> bool:
    """Whether a folder holds a run in any of its sub-folders (compare's and the demo's output_root)."""
    return any(child.is_dir() and holds_run(child) for child in Path(root).iterdir())
