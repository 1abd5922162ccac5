"""A task's examples (local GLUE/SuperGLUE folder, HF datasets, the user's files); sampled as MeZO does."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xgblora.config import DataOptions
from xgblora.data.sources import read_rows
from xgblora.data.tasks import CustomTask, Example, Task
from xgblora.errors import UserError

log = logging.getLogger("xgblora")

@dataclass
class Splits:
    """The examples of one run: training, dev (drawn from the train split, disjoint) and evaluation.

    `eval_is_own` marks an evaluation split from the user's own --eval_file: a validation set the user chose, which
    periodic evaluation may watch when there is no dev split (MeZO's evaluation split is a test set: never)."""

    train: list[Example]
    dev: list[Example]
    eval: list[Example]
    eval_is_own: bool = False

    @property
    def monitor(self) -> list[Example]:
        """What periodic evaluation and the best checkpoint read: the dev split, else the user's --eval_file."""
        return self.dev or (self.eval if self.eval_is_own else [])


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


def sample_splits(task: Task, cfg: DataOptions) -> Splits:
    """Train/dev/eval examples: every row of the user's own data by default, else MeZO's protocol.

    Own data (a custom or pair task) without --num_train: every row trains except a dev split, drawn with
    train_set_seed, when --num_dev or --eval_split_ratio asks for one; evaluation reads --eval_file, or nothing.
    Otherwise MeZO's protocol (large_models/tasks.py sample_subset and run.py): the train split is permuted with
    train_set_seed; its first num_train + num_dev examples are taken, dev being the last num_dev of them (with
    --dev_pool sentences, the first num_dev that pass `is_sentence` after the num_train). Eval is num_eval examples
    of the validation split permuted with seed 0 (all of them, in order, when num_eval is unset). A custom task
    without --eval_file evaluates on the train-file rows not drawn for train/dev (num_eval of them, drawn with
    seed 0, when set).

    Sampling is over examples, which is over rows for every task but MultiRC, whose SuperGLUE rows are
    paragraphs: MeZO samples MultiRC's answer-level rows (the HF layout), and the flattened examples are those
    rows in the same order, so both sources give MeZO's draw. SuperGLUE-layout ReCoRD rows are likewise
    flattened to one example per query.
    """
    own = isinstance(task, CustomTask)
    if own and cfg.num_train is None:
        return _all_rows(task, cfg)
    holdout = own and task.eval_file is None
    pool = load_rows(task, "train", cfg.data_dir) if cfg.num_train or cfg.num_dev or holdout or \
        cfg.eval_split_ratio else []
    num_dev = _dev_count(cfg, len(pool))
    wanted = cfg.num_train + num_dev
    if holdout and wanted >= len(pool):
        raise UserError(f"task 'custom': {task.train_file} has {len(pool)} examples, not enough for "
                        f"--num_train {cfg.num_train} + --num_dev {num_dev} and an evaluation set; "
                        f"pass --eval_file or lower --num_train (leave it out to train on every row)")
    n_train, n_dev = cfg.num_train, num_dev
    if wanted > len(pool):
        n_train = round(len(pool) * cfg.num_train / wanted)
        n_dev = len(pool) - n_train
        log.warning("%s: asked for %d train + %d dev examples but the train split has %d; using %d train + %d dev",
                    task.name, cfg.num_train, num_dev, len(pool), n_train, n_dev)
    order = _permutation(len(pool), cfg.train_set_seed)
    if cfg.dev_pool == "sentences":  # the train draw stays MeZO's; dev comes from the sentences after it
        order = order[:n_train] + [i for i in order[n_train:] if is_sentence(pool[i].prompt)]
    train = [pool[i] for i in order[:n_train]]
    dev = [pool[i] for i in order[n_train:n_train + n_dev]]
    if holdout:
        eval_pool = [pool[i] for i in sorted(order[n_train + n_dev:])]
    else:
        eval_pool = load_rows(task, "eval", cfg.data_dir)
    return Splits(train, dev, _draw_eval(task, cfg, eval_pool), eval_is_own=own and task.eval_file is not None)


def _dev_count(cfg: DataOptions, pool_size: int) -> int:
    """--num_dev, else --eval_split_ratio of the train rows (at least one), else 0."""
    if cfg.num_dev is not None:
        return cfg.num_dev
    return max(1, round(pool_size * cfg.eval_split_ratio)) if cfg.eval_split_ratio else 0


def _all_rows(task: CustomTask, cfg: DataOptions) -> Splits:
    """The user's own data: every row trains, but a dev split when one is asked for; --eval_file evaluates (alone,
    when only evaluating)."""
    pool = load_rows(task, "train", cfg.data_dir) if task.train_file else []
    n_dev = _dev_count(cfg, len(pool))
    if n_dev and n_dev >= len(pool):
        raise UserError(f"{task.train_file} has {len(pool)} examples, too few for a dev split of {n_dev} and "
                        f"training examples; lower --num_dev or --eval_split_ratio")
    order = _permutation(len(pool), cfg.train_set_seed)
    dev = [pool[i] for i in order[:n_dev]]
    train = [pool[i] for i in sorted(order[n_dev:])]  # the file's order; training draws its own
    eval_pool = load_rows(task, "eval", cfg.data_dir) if task.eval_file else []
    return Splits(train, dev, _draw_eval(task, cfg, eval_pool), eval_is_own=bool(eval_pool))


def _draw_eval(task: Task, cfg: DataOptions, eval_pool: list[Example]) -> list[Example]:
    """--num_eval examples of the evaluation pool, drawn with seed 0 (all of them, in order, when unset)."""
    if cfg.num_eval is None:
        return eval_pool
    if cfg.num_eval > len(eval_pool):
        log.warning("%s: asked for %d eval examples but there are %d; using all %d", task.name, cfg.num_eval,
                    len(eval_pool), len(eval_pool))
    return [eval_pool[i] for i in _permutation(len(eval_pool), 0)[:cfg.num_eval]]
