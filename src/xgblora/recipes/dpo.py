"""`xgblora dpo`: preference training on chosen / rejected pairs through the training loop (`Trainer.fit`).

The pairs are read and checked before the model loads. What trains is set up as in `xgblora train` (LoRA,
XGBLoRA, full; AdamW or --trainer zo); the loss is `PreferenceLoss` on `PreferenceBatch`es. The reference policy:
the model with its LoRA adapter switched off, for a LoRA run that starts from the base; otherwise (XGBLoRA, whose
merged boosters change the base weights; full fine-tuning; a continued --adapter) the starting model's
log-probabilities of every pair, computed once before the first step, so no second model is kept. Held-out pairs
(--eval_file) are scored with their reference log-probabilities computed at the start, the same way. That
reference and the Trainer over the rows' batches are written once here for every preference recipe (`xgblora kto`
too).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from xgblora.adapters.lora import adapters_off
from xgblora.config import DPOConfig, KTOConfig
from xgblora.data import formats
from xgblora.data.batches import PreferenceBatch
from xgblora.data.preference import (
    PreferenceExample,
    PreferenceSeq,
    collate_preferences,
    encode,
    encode_all,
    read_preferences,
)
from xgblora.distributed import Distributed
from xgblora.errors import located
from xgblora.evaluation.answers import make_verifier
from xgblora.evaluation.evaluators import Evaluator
from xgblora.logs import setup_console_logging
from xgblora.models.sampler import greedy_continuations
from xgblora.preference.kto import KTOLoss
from xgblora.preference.objective import Objective
from xgblora.preference.scoring import PreferenceLoss, Row, evaluate_pairs, reference_logps
from xgblora.recipes.lifecycle import Prepared, run_recipe
from xgblora.report import DPO_PANELS
from xgblora.train.loop import ExampleBatches, Trainer
from xgblora.train.objective import TrainingSet
from xgblora.train.setup import Method, TrainingRun, load_policy, setup_method, training_loss

log = logging.getLogger("xgblora")

Collate = Callable[[Sequence[Row], torch.Tensor | None], PreferenceBatch]  # rows, their reference sums -> a batch


def run_dpo(cfg: DPOConfig) -> dict[str, Any]:
    """Train on cfg.train_file's pairs; return the run's results (also written to results.json)."""
    setup_console_logging()
    train = read_preferences(cfg.train_file, cfg.columns)
    held_out = read_preferences(cfg.eval_file, cfg.columns, "eval") if cfg.eval_file else []
    if cfg.verifier:
        make_verifier(cfg.verifier)  # a bad spec fails before the model loads
        if missing := next((ex for ex in held_out if ex.reference is None), None):
            raise located(*missing.where, "reference", "missing: --verifier checks each --eval_file prompt's greedy "
                                                       "completion against its row's reference answer")
    template = formats.read_chat_template(cfg.chat_template) if cfg.chat_template else None
    return run_recipe(cfg, lambda dist: _recipe(prepare(cfg, dist, train, held_out, template)))


def objective_of(cfg: DPOConfig) -> Objective:
    loss_type, weights = cfg.loss_terms
    return Objective(loss_type, weights, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma, cfg.reference_free)


@dataclass
class DPORun:
    """A set-up preference run: its resolved config, its Trainer (`fit()` trains), the number of training pairs, and
    the held-out pairs with their evaluator."""

    cfg: DPOConfig
    trainer: Trainer
    num_train: int
    eval_seqs: list[PreferenceSeq]
    evaluate: Evaluator


def _recipe(run: DPORun) -> Prepared:
    """The run in the lifecycle's terms: after fit(), the held-out pairs' reward accuracy (and pass@1)."""
    cfg = run.cfg

    def results() -> dict[str, Any]:
        done = {"loss_type": list(cfg.loss_terms[0]), "beta": cfg.beta, "num_train": run.num_train,
                "num_eval": len(run.eval_seqs)}
        if run.eval_seqs:
            done.update({f"eval_{k}": v for k, v in run.evaluate(run.trainer.run.model, run.eval_seqs)[0].items()})
        return done

    return Prepared(cfg, run.trainer.run.device, run.trainer, results, data=cfg.train_file, tags=("dpo",),
                    curves=("dpo", DPO_PANELS))


def prepare(cfg: DPOConfig, dist: Distributed, train: list[PreferenceExample],
            held_out: list[PreferenceExample], template: str | None = None) -> DPORun:
    """Load the model, tokenise the pairs, set up what trains and the reference (see the module docstring)."""
    cfg, model, tokenizer = load_policy(cfg, dist, template)
    device, pad = next(model.parameters()).device, tokenizer.pad_token_id
    train_seqs = encode_all(tokenizer, train, cfg.max_length, cfg.max_prompt_length)
    eval_seqs = encode_all(tokenizer, held_out, cfg.max_length, cfg.max_prompt_length) if held_out else []
    method = setup_method(model, cfg)
    objective = objective_of(cfg)
    reference = live_reference(cfg, method)

    def collate(rows: Sequence[PreferenceSeq], ref: torch.Tensor | None = None) -> PreferenceBatch:
        return collate_preferences(rows, pad, ref)

    def starting(seqs: Sequence[PreferenceSeq]) -> torch.Tensor | None:
        return starting_logps(cfg, model, seqs, collate, reference) if objective.needs_reference and seqs else None

    ref_train = None if reference is not None else starting(train_seqs)
    ref_eval = starting(eval_seqs)

    verifier = make_verifier(cfg.verifier) if cfg.verifier else None
    prompts = [encode(tokenizer, ex).prompt for ex in held_out] if verifier is not None else []
    stop_ids = formats.model_stop_ids(model, tokenizer)

    def evaluate(model: torch.nn.Module, seqs: Sequence[PreferenceSeq], demos: Sequence = ()) -> tuple[dict, list]:  # noqa: ARG001
        """Reward accuracy on the held-out pairs; with --verifier, also greedy pass@1 of their prompts."""
        metrics = evaluate_pairs(model, seqs, ref_eval, objective, pad, cfg.per_device_eval_batch_size, device)
        if verifier is not None:
            texts = greedy_continuations(model, tokenizer, prompts, stop_ids, batch_size=cfg.per_device_eval_batch_size,
                                         max_length=cfg.max_length, max_new_tokens=cfg.max_new_tokens)
            metrics["pass@1"] = sum(verifier.judge([text], ex.reference)[0]
                                    for text, ex in zip(texts, held_out, strict=True)) / len(held_out)
        return metrics, []

    run = TrainingRun(cfg, model, tokenizer, device, evaluate, monitor=eval_seqs)
    lengths = [len(s.prompt) + len(s.chosen) + len(s.rejected) for s in train_seqs]
    loss = PreferenceLoss(objective, reference, fused=cfg.fused_lm_head)
    trainer = preference_trainer(cfg, run, dist, method, TrainingSet(lengths, rows_of(train_seqs, collate, ref_train)),
                                 loss)
    return DPORun(cfg, trainer, len(train_seqs), eval_seqs, evaluate)


# What `xgblora dpo` and `xgblora kto` share: the reference, the rows' batches and the Trainer.

def live_reference(cfg: DPOConfig | KTOConfig, method: Method) -> Callable[[], AbstractContextManager] | None:
    """The reference as the model with its LoRA adapters off, where that is the starting model: a LoRA run from
    the base that precomputes nothing (the base stays as it was). None: the starting model's log-probabilities of
    every row are precomputed (`starting_logps`)."""
    live = cfg.method == "lora" and not cfg.adapter and not cfg.precompute_ref_log_probs
    return (lambda: adapters_off(method.modules)) if live else None


def starting_logps(cfg: DPOConfig | KTOConfig, model: torch.nn.Module, seqs: Sequence[Row], collate: Collate,
                   reference: Callable[[], AbstractContextManager] | None) -> torch.Tensor:
    """The reference's summed log-probabilities of every completion of every row [rows, k], computed once, in
    batches of --precompute_ref_batch_size (default --per_device_eval_batch_size)."""
    return reference_logps(model, seqs, collate, cfg.precompute_ref_batch_size or cfg.per_device_eval_batch_size,
                           next(model.parameters()).device, reference or contextlib.nullcontext)


def rows_of(seqs: Sequence[Row], collate: Collate,
            ref: torch.Tensor | None) -> Callable[[Sequence[int]], PreferenceBatch]:
    """A batch of the given rows, with their precomputed reference sums where there are some."""
    def batch(idx: Sequence[int]) -> PreferenceBatch:
        return collate([seqs[i] for i in idx], None if ref is None else ref[list(idx)])

    return batch


def preference_trainer(cfg: DPOConfig | KTOConfig, run: TrainingRun, dist: Distributed, method: Method,
                       train_set: TrainingSet, loss: PreferenceLoss | KTOLoss) -> Trainer:
    """The Trainer over the rows' batches (grouped by length unless --group_by_length false) and the preference
    loss (compiled with --compile). TRL's disable_dropout: the policy scores a row as the reference (taken without
    dropout) does, so the first step's log ratios are 0."""
    source = ExampleBatches(train_set, cfg, dist, cfg.group_by_length is not False, dropout=not cfg.disable_dropout)
    return Trainer(run, method, source, training_loss(run, dist, preference=loss), dist)
