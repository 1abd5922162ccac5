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
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xgblora import distributed, parsing
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
from xgblora.data.splits import Splits
from xgblora.errors import located
from xgblora.evaluation.answers import make_verifier
from xgblora.evaluation.evaluators import Evaluator
from xgblora.logs import setup_console_logging
from xgblora.models.sampler import greedy_continuations
from xgblora.preference.objective import Objective
from xgblora.preference.scoring import PreferenceLoss, evaluate_pairs, reference_logps
from xgblora.report import DPO_PANELS, write_curves_report
from xgblora.train.loop import ExampleBatches, Trainer
from xgblora.train.objective import TrainingSet
from xgblora.train.results import write_model_card, write_results
from xgblora.train.run import finished_results, run_folder, start_over
from xgblora.train.setup import RunSetup, load_policy, setup_method

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
    dist = distributed.setup(cfg)
    if (done := finished_results(cfg, Path(cfg.output_dir))) is not None:
        return done
    with run_folder(cfg, dist):
        return _run(cfg, dist, train, held_out, template)


def objective_of(cfg: DPOConfig) -> Objective:
    loss_type, weights = cfg.loss_terms
    return Objective(loss_type, weights, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma, cfg.reference_free)


@dataclass
class DPORun:
    """A set-up preference run: its resolved config, its Trainer (`fit()` trains), and the held-out pairs with
    their evaluator."""

    cfg: DPOConfig
    trainer: Trainer
    eval_seqs: list[PreferenceSeq]
    evaluate: Evaluator


def _run(cfg: DPOConfig, dist: distributed.Distributed, train: list[PreferenceExample],
         held_out: list[PreferenceExample], template: str | None) -> dict[str, Any]:
    run = prepare(cfg, dist, train, held_out, template)  # the last checks: a refused run writes nothing
    cfg, model = run.cfg, run.trainer.run.model
    if dist.is_main:
        if cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
            start_over(Path(cfg.output_dir))
        parsing.dump(cfg, Path(cfg.output_dir) / "config.yaml")
    summary = run.trainer.fit()
    before = {f"before_{k}": v for k, v in run.trainer.state.before.items()}
    results = {"model": cfg.model_name, "method": cfg.method, "trainer": cfg.trainer, "seed": cfg.seed,
               "loss_type": list(cfg.loss_terms[0]), "beta": cfg.beta, "num_train": len(run.trainer.run.splits.train),
               "num_eval": len(run.eval_seqs), "device": str(run.trainer.run.device), "torch": torch.__version__,
               **summary, **before}
    if run.eval_seqs:
        results.update({f"eval_{k}": v for k, v in run.evaluate(model, run.eval_seqs)[0].items()})
    if dist.is_main:
        write_model_card(cfg, results)
        write_curves_report(Path(cfg.output_dir), results, "dpo", DPO_PANELS)
        write_results(cfg, results)  # last: results.json marks a finished run
    return results


def prepare(cfg: DPOConfig, dist: distributed.Distributed, train: list[PreferenceExample],
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
    method = dataclasses.replace(method, preference=PreferenceLoss(objective, reference, fused=cfg.fused_lm_head))

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

    splits = Splits(train=list(train_seqs), dev=[], eval=list(eval_seqs), eval_is_own=True)
    run = RunSetup(cfg, task=None, splits=splits, head="lm", model=model, tokenizer=tokenizer, scoring=None,
                   device=device, evaluate=evaluate)
    # TRL's disable_dropout: the policy scores a pair as the reference (taken without dropout) does, so the first
    # step's log ratios are 0 and the loss is log 2
    source = ExampleBatches(training_set(train_seqs, pad, ref_train), cfg, dist, dropout=not cfg.disable_dropout)
    return DPORun(cfg, Trainer(run, method, source, dist), eval_seqs, evaluate)


def training_set(seqs: Sequence[PreferenceSeq], pad_id: int, ref: torch.Tensor | None) -> TrainingSet:
    """The pairs, grouped by length (prompt and both completions), each batch with its pairs' reference sums."""
    def batch(idx: Sequence[int]):
        return collate_preferences([seqs[i] for i in idx], pad_id, None if ref is None else ref[list(idx)])

    return TrainingSet([len(s.prompt) + len(s.chosen) + len(s.rejected) for s in seqs], batch)

