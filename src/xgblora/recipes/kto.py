"""`xgblora kto`: KTO on unpaired rows (a completion and whether it is desirable) through the training loop.

The rows are read and checked before the model loads (a preference file's pairs are unpaired, as TRL does). What
trains is set up as in `xgblora dpo`, and the reference is had the same way (the model with its LoRA adapter off,
or the starting model's log-probabilities computed once: recipes/dpo.py); the loss is `KTOLoss` on
`PreferenceBatch`es of rows, each with its mismatched completion for the KL estimate. Held-out rows (--eval_file)
are scored with the loss and TRL's metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xgblora.config import KTOConfig
from xgblora.data import formats
from xgblora.data.batches import PreferenceBatch
from xgblora.data.unpaired import UnpairedExample, UnpairedSeq, collate_unpaired, encode_all, read_unpaired
from xgblora.distributed import Distributed
from xgblora.evaluation.evaluators import Evaluator
from xgblora.logs import setup_console_logging
from xgblora.preference.kto import KTOLoss, KTOObjective, evaluate_unpaired
from xgblora.recipes.dpo import live_reference, preference_trainer, rows_of, starting_logps
from xgblora.recipes.lifecycle import Prepared, run_recipe
from xgblora.report import KTO_PANELS
from xgblora.train.loop import Trainer
from xgblora.train.objective import TrainingSet
from xgblora.train.setup import TrainingRun, load_policy, setup_method

log = logging.getLogger("xgblora")


def run_kto(cfg: KTOConfig) -> dict[str, Any]:
    """Train on cfg.train_file's rows; return the run's results (also written to results.json)."""
    setup_console_logging()
    train = read_unpaired(cfg.train_file, cfg.columns)
    held_out = read_unpaired(cfg.eval_file, cfg.columns, "eval") if cfg.eval_file else []
    if (advice := weight_advice(cfg, train)) is not None:
        log.warning("%s", advice)
    template = formats.read_chat_template(cfg.chat_template) if cfg.chat_template else None
    return run_recipe(cfg, lambda dist: _recipe(prepare(cfg, dist, train, held_out, template)))


def objective_of(cfg: KTOConfig) -> KTOObjective:
    return KTOObjective(cfg.loss_type, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight)


def weight_advice(cfg: KTOConfig, rows: Sequence[UnpairedExample]) -> str | None:
    """TRL's warning where desirable and undesirable rows differ in number and neither weight is in the range that
    Eq. (8) of the KTO paper recommends for the counts; None where they are balanced or a weight is in range."""
    desirable = max(sum(ex.label for ex in rows), 1)
    undesirable = max(len(rows) - desirable, 1)
    if desirable == undesirable:
        return None
    d_low, d_high = (round(undesirable * cfg.undesirable_weight / desirable * f, 2) for f in (1, 1.33))
    u_low, u_high = (round(desirable * cfg.desirable_weight / undesirable / f, 2) for f in (1.33, 1))
    if d_low <= cfg.desirable_weight <= d_high or u_low <= cfg.undesirable_weight <= u_high:
        return None
    return (f"{desirable} desirable and {undesirable} undesirable training rows, and the loss weights are outside "
            f"the range the KTO paper recommends for them: pass either --desirable_weight in [{d_low}, {d_high}] "
            f"or --undesirable_weight in [{u_low}, {u_high}] (not both)")


@dataclass
class KTORun:
    """A set-up KTO run: its resolved config, its Trainer (`fit()` trains), its training rows' labels, and the
    held-out rows with their evaluator."""

    cfg: KTOConfig
    trainer: Trainer
    labels: list[bool]
    eval_seqs: list[UnpairedSeq]
    evaluate: Evaluator


def _recipe(run: KTORun) -> Prepared:
    """The run in the lifecycle's terms: after fit(), the held-out rows' loss and metrics."""
    cfg = run.cfg

    def results() -> dict[str, Any]:
        done = {"loss_type": cfg.loss_type, "beta": cfg.beta, "desirable_weight": cfg.desirable_weight,
                "undesirable_weight": cfg.undesirable_weight, "num_train": len(run.labels),
                "num_desirable": sum(run.labels), "num_eval": len(run.eval_seqs)}
        if run.eval_seqs:
            done.update({f"eval_{k}": v for k, v in run.evaluate(run.trainer.run.model, run.eval_seqs)[0].items()})
        return done

    return Prepared(cfg, run.trainer.run.device, run.trainer, results, data=cfg.train_file, tags=("kto",),
                    curves=("kto", KTO_PANELS))


def prepare(cfg: KTOConfig, dist: Distributed, train: list[UnpairedExample], held_out: list[UnpairedExample],
            template: str | None = None) -> KTORun:
    """Load the model, tokenise the rows with their KL completions, set up what trains and the reference."""
    cfg, model, tokenizer = load_policy(cfg, dist, template)
    device, pad = next(model.parameters()).device, tokenizer.pad_token_id
    objective = objective_of(cfg)
    # TRL pairs held-out rows in blocks of the training batch size too
    block = cfg.per_device_train_batch_size if objective.estimates_kl else None
    train_seqs = encode_all(tokenizer, train, cfg.max_length, block)
    eval_seqs = encode_all(tokenizer, held_out, cfg.max_length, block) if held_out else []
    method = setup_method(model, cfg)
    reference = live_reference(cfg, method)

    def collate(rows: Sequence[UnpairedSeq], ref: torch.Tensor | None = None) -> PreferenceBatch:
        return collate_unpaired(rows, pad, ref)

    ref_train = None if reference is not None else starting_logps(cfg, model, train_seqs, collate, reference)
    ref_eval = starting_logps(cfg, model, eval_seqs, collate, reference) if eval_seqs else None

    def evaluate(model: torch.nn.Module, seqs: Sequence[UnpairedSeq], demos: Sequence = ()) -> tuple[dict, list]:  # noqa: ARG001
        """The loss and TRL's metrics on the held-out rows."""
        return evaluate_unpaired(model, seqs, ref_eval, objective, pad, cfg.per_device_eval_batch_size, device), []

    run = TrainingRun(cfg, model, tokenizer, device, evaluate, monitor=eval_seqs)
    lengths = [len(s.prompt) + len(s.completion) + len(s.kl_completion or ()) for s in train_seqs]
    loss = KTOLoss(objective, reference, fused=cfg.fused_lm_head, dist=dist)
    trainer = preference_trainer(run, dist, method, TrainingSet(lengths, rows_of(train_seqs, collate, ref_train)),
                                 loss)
    return KTORun(cfg, trainer, [s.label for s in train_seqs], eval_seqs, evaluate)
