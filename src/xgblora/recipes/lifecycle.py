"""The run lifecycle, written once for every training command: join the processes, return a finished run's results
when asked to resume it, check and lock the output folder, set up (the recipe's `prepare`: the last checks, so a
refused run writes nothing), start over where asked, write config.yaml, fit, and write the model card, the curves
report and results.json (last: its presence marks a finished run)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xgblora import atomic, checkpoint, distributed, outputs, parsing
from xgblora.config import TrainerConfig
from xgblora.errors import UserError
from xgblora.logs import setup_console_logging
from xgblora.options import ResultFileOptions
from xgblora.report import write_curves_report
from xgblora.train.lock import run_lock
from xgblora.train.loop import Trainer
from xgblora.train.results import write_model_card, write_result_file, write_results

log = logging.getLogger("xgblora")


@dataclass
class Prepared:
    """A recipe's run, set up inside the folder lock: its resolved config and device, its Trainer (None: evaluation
    only), and what it adds to results.json after fit() (`results`: its evaluation and counts); the model card's
    `data` (what it trained on), extra `tags` and `notes`; the curves report's (name, panels), if it draws one."""

    cfg: TrainerConfig
    device: torch.device
    trainer: Trainer | None
    results: Callable[[], dict[str, Any]]
    data: str
    tags: Sequence[str] = ()
    notes: str = ""
    curves: tuple[str, Sequence[tuple[str, str]]] | None = None


def run_recipe(cfg: TrainerConfig, prepare: Callable[[distributed.Distributed], Prepared]) -> dict[str, Any]:
    """Run a recipe through the lifecycle (see the module docstring); return its results (also results.json)."""
    setup_console_logging()
    dist = distributed.setup(cfg)  # before the model loads: it picks this rank's GPU
    if (done := finished_results(cfg, Path(cfg.output_dir))) is not None:
        return done
    with held_output_dir(cfg, dist) as out:
        run = prepare(dist)
        if dist.is_main:
            if run.trainer is not None and cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
                start_over(out)
            parsing.dump(run.cfg, out / "config.yaml")
        summary = run.trainer.fit() if run.trainer is not None else {}
        before = run.trainer.state.before if run.trainer is not None else {}  # --eval_on_start
        # the model as the user named it: a run folder evaluated stays that folder, not the base it resolves to
        results = {"model": cfg.model_name, "method": run.cfg.method, "trainer": run.cfg.trainer,
                   "seed": run.cfg.seed, "device": str(run.device), "torch": torch.__version__, **summary,
                   **{f"before_{k}": v for k, v in before.items()}, **run.results()}
        if dist.is_main:
            write_model_card(run.cfg, results, run.data, run.tags, run.notes)
            if run.curves is not None:
                write_curves_report(out, results, *run.curves)
            if isinstance(run.cfg, ResultFileOptions):  # train's and mezo's copy under MeZO's result-file name
                write_result_file(run.cfg, results)
            write_results(run.cfg, results)  # last: results.json marks a finished run
    return results


@contextlib.contextmanager
def held_output_dir(cfg: TrainerConfig, dist: distributed.Distributed) -> Iterator[Path]:
    """The run's --output_dir, checked (`check_folder`) and held by the main process's lock while the run writes
    it; a refused or failed run that wrote nothing leaves no folder behind. A folder of other files than an
    earlier run's is refused before anything is created in it."""
    out = Path(cfg.output_dir)
    outputs.check_run_folder(out)
    check = functools.partial(check_folder, cfg, out)
    if not dist.is_main:
        check()
    with atomic.output_folder(out, "--output_dir"), \
            run_lock(out, check) if dist.is_main else contextlib.nullcontext():  # the main process owns the folder
        yield out


def finished_results(cfg: TrainerConfig, out: Path) -> dict[str, Any] | None:
    """A finished run asked to resume has nothing left to do: its results (None for any other run). Asked to
    train longer than it did, it refuses: its schedule ended, so the model is trained on in a new run."""
    path = out / "results.json"
    if not cfg.resume_from_checkpoint or cfg.overwrite_output_dir or not path.is_file():
        return None
    results = json.loads(path.read_text(encoding="utf-8"))
    if _asks_for_more(cfg, out, results):
        raise UserError(f"{out} holds a finished run of {results['steps']} steps, and a finished run does not "
                        f"resume; train its model further in a new folder with --model_name {out} --output_dir "
                        f"NEW_DIR (a new optimizer state and schedule), or redo it with --overwrite_output_dir")
    log.warning("%s holds a finished run (results.json): nothing to resume; pass --overwrite_output_dir to train "
                "it again", out)
    return results


def _asks_for_more(cfg: TrainerConfig, out: Path, results: dict[str, Any]) -> bool:
    """Whether cfg trains longer than the finished run in out did: more --max_steps, or more epochs."""
    if cfg.max_steps > 0:
        return "steps" in results and cfg.max_steps > results["steps"]
    earlier = checkpoint.run_config(out)
    return earlier.get("max_steps") == -1 and cfg.num_train_epochs > earlier.get("num_train_epochs", 0)


def check_folder(cfg: TrainerConfig, out: Path) -> None:
    """Refuse, before anything is written, a folder whose earlier run this one would write over: a finished run's
    results, or the checkpoints of an interrupted one (unless told to resume it or to start over)."""
    if cfg.overwrite_output_dir or cfg.resume_from_checkpoint:
        return
    if (out / "results.json").exists():
        raise UserError(f"{out} already holds a finished run's results.json; pass --overwrite_output_dir to redo "
                        f"it, or another --output_dir")
    if found := checkpoint.step_checkpoints(out / "checkpoints"):
        raise UserError(f"{out} holds an interrupted run (last checkpoint {found[-1]}); continue it with "
                        f"--resume_from_checkpoint latest, or start over with --overwrite_output_dir")


def start_over(out: Path) -> None:
    """--overwrite_output_dir: an earlier run's results and checkpoints go before this run writes its own."""
    (out / "results.json").unlink(missing_ok=True)  # first: a kill from here on leaves an unfinished run
    checkpoint.clear(out / "checkpoints")
