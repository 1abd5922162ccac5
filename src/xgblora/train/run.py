"""`xgblora train` / `xgblora eval`: set the run up, then evaluate only or train, then write the results."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from xgblora import atomic, distributed
from xgblora.config import Config
from xgblora.errors import UserError
from xgblora.logs import setup_console_logging
from xgblora.train.lock import run_lock
from xgblora.train.loop import Hooks, Trainer
from xgblora.train.results import write_model_card, write_predictions, write_results
from xgblora.train.setup import RunSetup, build_contrastive, init_head, set_up_run, setup_method, training_set

log = logging.getLogger("xgblora")


def run(cfg: Config, hooks: Hooks | None = None) -> dict[str, Any]:
    """Run what cfg asks for and return the final metrics (also written to results.json)."""
    setup_console_logging()
    dist = distributed.setup(cfg)  # before the model loads: it picks this rank's GPU
    out = Path(cfg.output_dir)
    with atomic.output_folder(out, "--output_dir"), \
            run_lock(out) if dist.is_main else contextlib.nullcontext():  # the main process owns the folder
        return _run(cfg, dist, out, hooks)


def _run(cfg: Config, dist: distributed.Distributed, out: Path, hooks: Hooks | None) -> dict[str, Any]:
    """Inside the run lock: refuse a finished run's folder, set up, evaluate or train, write results.json."""
    if cfg.trainer != "none" and (out / "results.json").exists() and not cfg.overwrite_output_dir \
            and not cfg.resume_from_checkpoint:
        raise UserError(f"{out} already holds a finished run; pass --overwrite_output_dir to redo it, "
                        f"or another --output_dir")
    setup = set_up_run(cfg, dist)
    base = {"task": setup.task.name, "model": cfg.model_name, "head": setup.head, "trainer": cfg.trainer,
            "seed": cfg.seed, "num_eval": len(setup.splits.eval), "device": str(setup.device),
            "torch": torch.__version__}
    results = {**base, **(_evaluate_only(setup) if cfg.trainer == "none" else _train(setup, dist, hooks))}
    if dist.is_main:
        write_model_card(setup.cfg, results)
        write_results(setup.cfg, results)  # last: results.json marks a finished run
    return results


def _evaluate_only(setup: RunSetup) -> dict[str, Any]:
    """Zero-shot, or in-context with the training examples as demonstrations (causal LMs)."""
    if setup.head == "classifier":
        log.warning("--head classifier without training scores with a new, untrained head: expect chance accuracy")
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
    summary = Trainer(setup, method, train_set, dist, hooks).fit()
    results = {**summary, "method": cfg.method, "num_train": len(setup.splits.train)}
    if method.contrastive is not None:  # learnt or fixed, the temperature the embeddings were trained at
        results["temperature"] = round(1 / float(method.contrastive.scale), 6)
    if not cfg.no_eval and setup.splits.eval:
        metrics, predictions = setup.evaluate(setup.model, setup.splits.eval)
        write_predictions(cfg, predictions)
        results.update(metrics)
    return results
