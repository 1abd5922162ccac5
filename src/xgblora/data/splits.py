"""A task's examples (local GLUE/SuperGLUE folder, HF datasets, the user's files); sampled as MeZO does."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xgblora.config import Config
from xgblora.data.sources import read_rows
from xgblora.data.tasks import CustomTask, Example, Task
from xgblora.errors import UserError


@dataclass
class Splits:
    """The examples of one run: training, dev (drawn from the train split, disjoint) and evaluation."""

    train: list[Example]
    dev: list[Example]
    eval: list[Example]


def _from_file(task: Task, source: str, split: str = "train", columns: dict[str, str] | None = None) -> list[Example]:
    return [ex for where, row in read_rows(source, split, columns) for ex in task.examples(row, where)]


def _task_file(task: Task, data_dir: Path, split: str) -> Path:
    """DIR/<dir_name>/{train,dev}.jsonl; the folder name matches in any case, and val.jsonl stands in for
    dev.jsonl (the layout of the official SuperGLUE download)."""
    if not data_dir.is_dir():
        raise UserError(f"--data_dir {data_dir}: no such folder")
    folders = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    match = [name for name in folders if name.lower() == task.dir_name]
    if not match:
        raise UserError(f"--data_dir {data_dir}: no folder {task.dir_name!r} for task {task.name} "
                        f"(it holds: {', '.join(folders) or 'no folders'})")
    folder = data_dir / match[0]
    if split == "train":
        return folder / "train.jsonl"
    dev = folder / "dev.jsonl"
    return dev if dev.exists() or not (folder / "val.jsonl").exists() else folder / "val.jsonl"


def _from_hub(task: Task, split_name: str) -> list[Example]:
    import datasets  # slow to import, and only this path needs it

    source = "/".join(part for part in task.hf_dataset if part)
    try:
        rows = datasets.load_dataset(*task.hf_dataset, split=split_name)
    except Exception as exc:  # connection, offline mode, not found, bad config...: all mean "cannot load"
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UserError(f"cannot load {source} [{split_name}] from Hugging Face datasets "
                        f"({type(exc).__name__}: {first}); without hub access, pass --data_dir DIR holding "
                        f"{task.dir_name}/train.jsonl and {task.dir_name}/dev.jsonl") from None
    where = f"{source}[{split_name}]"
    return [ex for i, row in enumerate(rows) for ex in task.examples(dict(row), (where, i))]


def load_rows(task: Task, split: str, data_dir: str | None) -> list[Example]:
    """All examples of a split ('train' or 'eval'): from DIR/<task>/, HF datasets, or the custom files."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if isinstance(task, CustomTask):
        source = task.train_file if split == "train" else task.eval_file
        if source is None:
            raise UserError("task 'custom' has no --eval_file")
        return _from_file(task, source, split, task.columns)
    if data_dir is not None:
        return _from_file(task, str(_task_file(task, Path(data_dir), split)))
    return _from_hub(task, task.hf_splits[0 if split == "train" else 1])


def _permutation(n: int, seed: int) -> list[int]:
    """MeZO's `with temp_seed(seed): np.random.permutation(n)`, without touching numpy's global state."""
    return np.random.RandomState(seed).permutation(n).tolist()


_SENTENCE_END = re.compile(r"[.!?]\s")


def is_sentence(prompt: str) -> bool:
    """Whether a prompt holds a full sentence: at least 8 words and a sentence-final mark followed by more text
    (the template's cue, e.g. SST-2's "... . It was")."""
    return len(prompt.split()) >= 8 and _SENTENCE_END.search(prompt) is not None


def _check_counts(cfg: Config) -> None:
    for flag in ("num_train", "num_dev", "num_eval"):
        value = getattr(cfg, flag)
        if value is not None and value < 0:
            raise UserError(f"--{flag} must be 0 or more, got {value}")
    if not 0 <= cfg.train_set_seed < 2**32:
        raise UserError(f"--train_set_seed must be between 0 and 2**32 - 1, got {cfg.train_set_seed}")


def sample_splits(task: Task, cfg: Config) -> Splits:
    """Train/dev/eval examples by MeZO's protocol (large_models/tasks.py sample_subset and run.py).

    The train split is permuted with train_set_seed; its first num_train + num_dev examples are taken, dev
    being the last num_dev of them (with --dev_pool sentences, the first num_dev that pass `is_sentence` after the
    num_train). Eval is num_eval examples of the validation split permuted with seed 0
    (all of them, in order, when num_eval is unset). A custom task without --eval_file evaluates on the
    train-file rows not drawn for train/dev (num_eval of them, drawn with seed 0, when set).

    Sampling is over examples, which is over rows for every task but MultiRC, whose SuperGLUE rows are
    paragraphs: MeZO samples MultiRC's answer-level rows (the HF layout), and the flattened examples are those
    rows in the same order, so both sources give MeZO's draw. SuperGLUE-layout ReCoRD rows are likewise
    flattened to one example per query.
    """
    _check_counts(cfg)
    num_dev = cfg.num_dev or 0
    wanted = cfg.num_train + num_dev
    holdout = isinstance(task, CustomTask) and task.eval_file is None
    pool = load_rows(task, "train", cfg.data_dir) if wanted or holdout else []
    if holdout and wanted >= len(pool):
        raise UserError(f"task 'custom': {task.train_file} has {len(pool)} examples, not enough for "
                        f"--num_train {cfg.num_train} + --num_dev {num_dev} and an evaluation set; "
                        f"pass --eval_file or lower --num_train")
    n_train, n_dev = cfg.num_train, num_dev
    if wanted > len(pool):
        n_train = round(len(pool) * cfg.num_train / wanted)
        n_dev = len(pool) - n_train
        warnings.warn(f"{task.name}: asked for {cfg.num_train} train + {num_dev} dev examples but the train "
                      f"split has {len(pool)}; using {n_train} train + {n_dev} dev", stacklevel=2)
    order = _permutation(len(pool), cfg.train_set_seed)
    if cfg.dev_pool == "sentences":  # the train draw stays MeZO's; dev comes from the sentences after it
        order = order[:n_train] + [i for i in order[n_train:] if is_sentence(pool[i].prompt)]
    train = [pool[i] for i in order[:n_train]]
    dev = [pool[i] for i in order[n_train:n_train + n_dev]]
    if holdout:
        eval_pool = [pool[i] for i in sorted(order[n_train + n_dev:])]
    else:
        eval_pool = load_rows(task, "eval", cfg.data_dir)
    if cfg.num_eval is None:
        return Splits(train, dev, eval_pool)
    if cfg.num_eval > len(eval_pool):
        warnings.warn(f"{task.name}: asked for {cfg.num_eval} eval examples but there are {len(eval_pool)}; "
                      f"using all {len(eval_pool)}", stacklevel=2)
    return Splits(train, dev, [eval_pool[i] for i in _permutation(len(eval_pool), 0)[:cfg.num_eval]])
