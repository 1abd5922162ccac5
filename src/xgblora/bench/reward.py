"""`xgblora bench --suite reward`: xgblora's reward-model step against TRL's `RewardTrainer` + PEFT LoRA, as
`--suite dpo` compares DPO (bench/dpo.py: the same model, LoRA on every linear layer of the blocks, optimiser, sizes
and pair file), the model loaded as a sequence classifier with one output and its new score head trained beside
the adapter on both sides (PEFT's SEQ_CLS keeps it in modules_to_save); TRL's RewardConfig defaults otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from xgblora import atomic
from xgblora.bench.dpo import (
    LORA,
    PreferenceCase,
    Suite,
    options,
    run_suite,
    suite_memory,
    suite_table,
    trl_options,
)
from xgblora.bench.sft import chat_tokenizer
from xgblora.config import RewardConfig
from xgblora.data.preference import read_preferences
from xgblora.distributed import LOCAL
from xgblora.models import pretrained
from xgblora.recipes.lifecycle import Prepared
from xgblora.recipes.reward import prepare


def xgblora_run(case: PreferenceCase, pairs: Path, output_dir: str) -> Prepared:
    """xgblora's reward run for the case, as `xgblora reward` builds it (a reward model has no beta)."""
    own = {k: v for k, v in options(case, pairs, output_dir).items() if k != "beta"}
    return prepare(RewardConfig(**own), LOCAL, read_preferences(str(pairs)), [])


def trl_trainer(case: PreferenceCase, pairs: Path, callbacks: list[Any], output_dir: str) -> Any:
    """TRL's RewardTrainer with PEFT LoRA shaped like xgblora's, on the same pair file."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    model, _ = pretrained.load(case.model_name, device=case.device, head="classifier", num_labels=1)
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="SEQ_CLS")
    config = trl.RewardConfig(**{k: v for k, v in trl_options(case, output_dir).items() if k != "beta"})
    return trl.RewardTrainer(model=model, args=config,
                             train_dataset=Dataset.from_list(atomic.jsonl_rows(pairs.read_text(encoding="utf-8"))),
                             processing_class=chat_tokenizer(case.model_name), peft_config=lora, callbacks=callbacks)


REWARD = Suite("reward", "pairs", xgblora_run, trl_trainer)


def memory_worker(config: dict[str, Any]) -> dict[str, float]:
    return suite_memory(config, REWARD)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    return run_suite(args, REWARD, "xgblora.bench.reward")


def format_table(results: list[dict[str, Any]]) -> str:
    return suite_table(results, REWARD)
