"""`xgblora train` / `xgblora eval`: set the run up, then evaluate only or train, then write the results."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from xgblora import atomic, checkpoint, distributed, outputs
from xgblora.adapters import trained
from xgblora.config import Config
from xgblora.errors import UserError
from xgblora.logs import setup_console_logging
from xgblora.train.corpus_eval import evaluate_retrieval
from xgblora.train.lock import run_lock
from xgblora.train.loop import ExampleBatches, Hooks, Trainer
from xgblora.train.results import write_model_card, write_predictions, write_results
from xgblora.train.setup import (
    RunSetup,
    build_contrastive,
    init_head,
    set_up_run,
    setup_method,
    training_set,
    write_config,
)

log = logging.getLogger("xgblora")


def run(cfg: Config, hooks: Hooks | None = None) -> dict[str, Any]:
    """Run what cfg asks for and return the final metrics (also written to results.json)."""
    setup_console_logging()
    dist = distributed.setup(cfg)  # before the model loads: it picks this rank's GPU
    if (done := finished_results(cfg, Path(cfg.output_dir))) is not None:
        return done
    with run_folder(cfg, dist) as out:
        return _run(cfg, dist, out, hooks)


@contextlib.contextmanager
def run_folder(cfg: Config, dist: distributed.Distributed) -> Iterator[Path]:
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


def finished_results(cfg: Config, out: Path) -> dict[str, Any] | None:
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


def _asks_for_more(cfg: Config, out: Path, results: dict[str, Any]) -> bool:
    """Whether cfg trains longer than the finished run in out did: more --max_steps, or more epochs."""
    if cfg.max_steps > 0:
        return "steps" in results and cfg.max_steps > results["steps"]
    earlier = checkpoint.run_config(out)
    return earlier.get("max_steps") == -1 and cfg.num_train_epochs > earlier.get("num_train_epochs", 0)


def check_folder(cfg: Config, out: Path) -> None:
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


def _run(cfg: Config, dist: distributed.Distributed, out: Path, hooks: Hooks | None) -> dict[str, Any]:
    """Inside the run lock (the folder checked): set up, evaluate or train, write results.json."""
    if (files := cfg.retrieval_files) is not None:
        cfg, results = evaluate_retrieval(cfg, files, dist)
    else:
        setup = set_up_run(cfg, dist)
        base = {"task": setup.task.name, "model": cfg.model_name, "head": setup.head, "trainer": cfg.trainer,
                "seed": cfg.seed, "num_eval": len(setup.splits.eval), "device": str(setup.device),
                "torch": torch.__version__}
        results = {**base, **(_evaluate_only(setup, dist) if cfg.trainer == "none" else _train(setup, dist, hooks))}
        cfg = setup.cfg
    if dist.is_main:
        write_model_card(cfg, results)
        write_results(cfg, results)  # last: results.json marks a finished run
    return results


def _evaluate_only(setup: RunSetup, dist: distributed.Distributed) -> dict[str, Any]:
    """Zero-shot, or in-context with the training examples as demonstrations (causal LMs)."""
    if setup.head == "classifier" and not trained.carries_head(setup.cfg.model_name, setup.cfg.adapter):
        log.warning("--head classifier without training scores with a new, untrained head: expect chance accuracy")
    write_config(setup, dist)
    started = time.perf_counter()
    demos = setup.splits.train if setup.scoring is None else ()
    metrics, predictions = setup.evaluate(setup.model, setup.splits.eval, demos)
    write_predictions(setup.cfg, predictions)
    return {**metrics, "method": "none", "num_demos": len(demos),
            "eval_runtime_s": round(time.perf_counter() - started, 3)}


def _train(setup: RunSetup, dist: distributed.Distributed, hooks: Hooks | None) -> dict[str, Any]:
    """Train, then evaluate on the evaluation split (every rank evaluates: FSDP needs them all)."""
    cfg = setup.cfg
    train_set = training_set(setup)  # before the adapters: the packing probe runs on the plain model
    method = setup_method(setup.model, cfg, build_contrastive(setup, dist))
    init_head(setup, method)
    trainer = Trainer(setup, method, ExampleBatches(train_set, cfg, dist), dist, hooks)  # the last checks: a refused run writes nothing
    if cfg.overwrite_output_dir and not cfg.resume_from_checkpoint and dist.is_main:
        start_over(Path(cfg.output_dir))
    write_config(setup, dist)
    summary = trainer.fit()
    results = {**summary, "method": cfg.method, "num_train": len(setup.splits.train)}
    if method.contrastive is not None:  # learnt or fixed, the temperature the embeddings were trained at
        results["temperature"] = round(1 / float(method.contrastive.scale), 6)
    if not cfg.no_eval and setup.splits.eval:
        metrics, predictions = setup.evaluate(setup.model, setup.splits.eval)
        write_predictions(cfg, predictions)
        results.update(metrics)
    return results
