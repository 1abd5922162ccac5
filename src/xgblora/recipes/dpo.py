"""`xgblora dpo`: preference training on chosen / rejected pairs through the training loop (`Trainer.fit`).

The pairs are read and checked before the model loads. What trains is set up as in `xgblora train` (LoRA,
XGBLoRA, full; AdamW or --trainer zo); the loss is `PreferenceLoss` on `PreferenceBatch`es. The reference policy:
the model with its LoRA adapter switched off, for a LoRA run that starts from the base; otherwise (XGBLoRA, whose
merged boosters change the base weights; full fine-tuning; a continued --adapter) the starting model's
log-probabilities of every pair, computed once before the first step, so no second model is kept. Held-out pairs
(--eval_file) are scored with their reference log-probabilities computed at the start, the same way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xgblora.adapters.lora import adapters_off
from xgblora.config import DPOConfig
from xgblora.data import formats
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
from xgblora.preference.objective import Objective
from xgblora.preference.scoring import PreferenceLoss, evaluate_pairs, reference_logps
from xgblora.recipes.lifecycle import Prepared, run_recipe
from xgblora.report import DPO_PANELS
from xgblora.train.loop import ExampleBatches, Trainer
from xgblora.train.objective import TrainingSet
from xgblora.train.setup import TrainingRun, load_policy, setup_method, training_loss

log = logging.getLogger("xgblora")


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
    # adapters off is the reference only while the base is the starting model and stays as it was
    live = cfg.method == "lora" and not cfg.adapter and not cfg.precompute_ref_log_probs
    reference = (lambda: adapters_off(method.modules)) if live else None
    batch_size = cfg.precompute_ref_batch_size or cfg.per_device_eval_batch_size

    def starting_logps(seqs: Sequence[PreferenceSeq]) -> torch.Tensor | None:
        if not objective.needs_reference or not seqs:
            return None
        return reference_logps(model, seqs, pad, batch_size, device, reference or contextlib.nullcontext)

    ref_train = None if live else starting_logps(train_seqs)
    ref_eval = starting_logps(eval_seqs)

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
    # TRL's disable_dropout: the policy scores a pair as the reference (taken without dropout) does, so the first
    # step's log ratios are 0 and the loss is log 2
    source = ExampleBatches(training_set(train_seqs, pad, ref_train), cfg, dist, cfg.group_by_length is not False,
                            dropout=not cfg.disable_dropout)
    loss = training_loss(run, dist, cfg.compile,
                         preference=PreferenceLoss(objective, reference, fused=cfg.fused_lm_head))
    return DPORun(cfg, Trainer(run, method, source, loss, dist), len(train_seqs), eval_seqs, evaluate)


def training_set(seqs: Sequence[PreferenceSeq], pad_id: int, ref: torch.Tensor | None) -> TrainingSet:
    """The pairs, grouped by length (prompt and both completions), each batch with its pairs' reference sums."""
    def batch(idx: Sequence[int]):
        return collate_preferences([seqs[i] for i in idx], pad_id, None if ref is None else ref[list(idx)])

    return TrainingSet([len(s.prompt) + len(s.chosen) + len(s.rejected) for s in seqs], batch)

