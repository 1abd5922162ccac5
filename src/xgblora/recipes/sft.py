"""`xgblora train` / `xgblora eval` / `xgblora mezo`: a task's examples (or the user's rows, or embedding pairs),
evaluated only or trained on, through the run lifecycle (`lifecycle.run_recipe`)."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from xgblora.adapters import trained
from xgblora.config import Config
from xgblora.distributed import Distributed
from xgblora.embeddings.st_format import matryoshka_card
from xgblora.recipes.lifecycle import Prepared, run_recipe
from xgblora.recipes.retrieval import prepare_retrieval
from xgblora.train.loop import ExampleBatches, Hooks, Trainer
from xgblora.train.results import write_predictions
from xgblora.train.setup import (
    RunSetup,
    build_contrastive,
    build_reranker,
    init_head,
    set_up_run,
    setup_method,
    training_loss,
    training_set,
)

log = logging.getLogger("xgblora")


def run(cfg: Config, hooks: Hooks | None = None) -> dict[str, Any]:
    """Run what cfg asks for and return the final metrics (also written to results.json)."""
    return run_recipe(cfg, functools.partial(prepare, cfg, hooks=hooks))


def prepare(cfg: Config, dist: Distributed, hooks: Hooks | None = None) -> Prepared:
    """Task, splits and model (`set_up_run`), then what trains, or under --trainer none the evaluation alone."""
    if (files := cfg.retrieval_files) is not None:
        return prepare_retrieval(cfg, files, dist)
    setup = set_up_run(cfg, dist)
    if cfg.trainer == "none":
        return _evaluation_only(setup)
    return _training(setup, dist, hooks)


def _card(setup: RunSetup) -> dict[str, Any]:
    """The model card's data (the task, or the user's file) and, for a Matryoshka embedding, its sizes."""
    cfg = setup.cfg
    matryoshka = cfg.embeds and bool(cfg.matryoshka_dims)
    return {"data": cfg.train_file if cfg.own_data else cfg.task_name,
            "tags": ("matryoshka",) if matryoshka else (),
            "notes": matryoshka_card(cfg.matryoshka_dims) if matryoshka else ""}


def _evaluation_only(setup: RunSetup) -> Prepared:
    """Zero-shot, or in-context with the training examples as demonstrations (causal LMs)."""
    if setup.head == "classifier" and not trained.carries_head(setup.cfg.model_name, setup.cfg.adapter):
        log.warning("--head classifier without training scores with a new, untrained head: expect chance accuracy")

    def results() -> dict[str, Any]:
        started = time.perf_counter()
        demos = setup.splits.train if setup.scoring is None else ()
        metrics, predictions = setup.evaluate(setup.model, setup.splits.eval, demos)
        write_predictions(setup.cfg, predictions)
        return {**_counts(setup), **metrics, "method": "none", "num_demos": len(demos),
                "eval_runtime_s": round(time.perf_counter() - started, 3)}

    return Prepared(setup.cfg, setup.device, None, results, **_card(setup))


def _training(setup: RunSetup, dist: Distributed, hooks: Hooks | None) -> Prepared:
    """What trains and its Trainer (the last checks: a refused run writes nothing); after fit(), the evaluation
    split is scored (every rank evaluates: FSDP needs them all)."""
    cfg = setup.cfg
    train_set = training_set(setup)  # before the adapters: the packing probe runs on the plain model
    contrastive = build_contrastive(setup, dist)
    method = setup_method(setup.model, cfg, contrastive)
    init_head(setup, method)
    run = setup.training_run()
    loss = training_loss(run, dist, contrastive, reranker=build_reranker(cfg))
    trainer = Trainer(run, method, ExampleBatches(train_set, cfg, dist, cfg.groups_by_length), loss, dist, hooks,
                      task=cfg, head=cfg)

    def results() -> dict[str, Any]:
        done = {**_counts(setup), "num_train": len(setup.splits.train)}
        if contrastive is not None:  # learnt or fixed, the temperature the embeddings were trained at
            done["contrastive_temperature"] = round(1 / float(contrastive.scale), 6)
        if not cfg.no_eval and setup.splits.eval:
            metrics, predictions = setup.evaluate(setup.model, setup.splits.eval)
            write_predictions(cfg, predictions)
            done.update(metrics)
        return done

    return Prepared(cfg, setup.device, trainer, results, **_card(setup))


def _counts(setup: RunSetup) -> dict[str, Any]:
    """What every train / eval run records of its task: the task, the head, the evaluation examples."""
    return {"task": setup.task.name, "head": setup.head, "num_eval": len(setup.splits.eval)}
