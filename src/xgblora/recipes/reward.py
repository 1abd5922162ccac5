"""`xgblora reward`: a reward model trained on chosen / rejected pairs through the training loop (`Trainer.fit`),
as TRL's RewardTrainer trains one.

The pairs (TRL's preference formats, read and checked as `xgblora dpo` reads them, with an optional margin column)
are read before the model loads. The model is a sequence classifier with one output, a new score head on the base
(`AutoModelForSequenceClassification`, num_labels 1); what trains is set up as in `xgblora train` (LoRA, XGBLoRA,
full; AdamW or --trainer zo), the head training in every method (under --trainer zo by AdamW on the features of
MeZO's forwards, as a classifier's head).
The loss is `RewardLoss` on `RewardBatch`es; a causal LM's classifier runs each pair's shared prompt once, both
sequences reading its KV cache (`preference.reward.shared_rewards`: TRL's values, fewer tokens). Held-out pairs (--eval_file) give the loss and the preference
accuracy. final/ holds the adapter with its head (PEFT's SEQ_CLS, the head as modules_to_save), or the whole
classifier; either serves as `xgblora grpo --reward_model`, and `xgblora export --format merged` writes a model that
transformers' AutoModelForSequenceClassification loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xgblora.config import RewardConfig
from xgblora.data import formats
from xgblora.data.preference import (
    PreferenceExample,
    RewardSeq,
    check_margins,
    collate_rewards,
    read_preferences,
    reward_seqs,
)
from xgblora.distributed import Distributed
from xgblora.logs import setup_console_logging
from xgblora.preference.reward import RewardLoss, evaluate_rewards, shares_prompts
from xgblora.recipes.lifecycle import Prepared, run_recipe
from xgblora.report import REWARD_PANELS
from xgblora.train.loop import ExampleBatches, Trainer
from xgblora.train.objective import TrainingSet
from xgblora.train.setup import TrainingRun, load_policy, setup_method, training_loss


def run_reward(cfg: RewardConfig) -> dict[str, Any]:
    """Train on cfg.train_file's pairs; return the run's results (also written to results.json)."""
    setup_console_logging()
    train = read_preferences(cfg.train_file, cfg.columns)
    held_out = read_preferences(cfg.eval_file, cfg.columns, "eval") if cfg.eval_file else []
    for examples in (train, held_out):
        check_margins(examples)
    template = formats.read_chat_template(cfg.chat_template) if cfg.chat_template else None
    return run_recipe(cfg, lambda dist: prepare(cfg, dist, train, held_out, template))


def prepare(cfg: RewardConfig, dist: Distributed, train: list[PreferenceExample],
            held_out: list[PreferenceExample], template: str | None = None) -> Prepared:
    """Load the classifier, tokenise the pairs, set up what trains (see the module docstring)."""
    cfg, model, tokenizer = load_policy(cfg, dist, template, head="classifier", num_labels=1)
    device, pad = next(model.parameters()).device, tokenizer.pad_token_id
    train_seqs = reward_seqs(tokenizer, train, cfg.max_length)
    eval_seqs = reward_seqs(tokenizer, held_out, cfg.max_length) if held_out else []
    method = setup_method(model, cfg)
    # each pair's prompt once (not through a compiled model, whose forward the backbone's bypasses, nor under FSDP,
    # whose root gathers the head's weights in its own forward)
    shared = shares_prompts(model, pad) and not cfg.compile and not dist.shards_model

    def evaluate(model: torch.nn.Module, seqs: Sequence[RewardSeq], demos: Sequence = ()) -> tuple[dict, list]:  # noqa: ARG001
        return evaluate_rewards(model, seqs, pad, cfg.per_device_eval_batch_size, device,
                                cfg.center_rewards_coefficient, shared), []

    run = TrainingRun(cfg, model, tokenizer, device, evaluate, monitor=eval_seqs)
    source = ExampleBatches(training_set(train_seqs, pad, shared), cfg, dist, cfg.group_by_length is not False,
                            dropout=not cfg.disable_dropout)
    loss = training_loss(run, dist, preference=RewardLoss(cfg.center_rewards_coefficient))
    trainer = Trainer(run, method, source, loss, dist, head=cfg)

    def results() -> dict[str, Any]:
        done: dict[str, Any] = {"num_train": len(train_seqs), "num_eval": len(eval_seqs)}
        if eval_seqs:
            done.update({f"eval_{k}": v for k, v in evaluate(model, eval_seqs)[0].items()})
        return done

    return Prepared(cfg, device, trainer, results, data=cfg.train_file, tags=("reward-model",),
                    curves=("reward", REWARD_PANELS))


def training_set(seqs: Sequence[RewardSeq], pad_id: int, shared: bool = False) -> TrainingSet:
    """The pairs, grouped by length (both sequences), each batch collated as TRL's collator does (shared: split at
    each pair's shared prompt too, `collate_rewards`)."""
    return TrainingSet([len(s.chosen) + len(s.rejected) for s in seqs],
                       lambda idx: collate_rewards([seqs[i] for i in idx], pad_id, shared))
