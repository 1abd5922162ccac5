"""`xgblora bench --suite reward`: xgblora's reward-model step against TRL's `RewardTrainer` + PEFT LoRA, as
`--suite dpo` compares DPO (bench/dpo.py: the same model, LoRA on every linear layer of the blocks, optimiser, sizes
and pair file), the model loaded as a sequence classifier with one output and its new score head trained beside
the adapter on both sides (PEFT's SEQ_CLS keeps it in modules_to_save); TRL's RewardConfig defaults otherwise, its
gradient checkpointing on; xgblora's off, as `xgblora reward` runs by default.

TRL runs a pair's two whole sequences, 2 (P + C) tokens, through the forward, again under its checkpointing and in
the backward (about 4 passes); xgblora runs the shared prompt once and both completions on its KV cache, P + 2C
tokens, keeping the activations (3 passes): with P = 129 and C = 33 (BOS and EOS included), 1296 against 585 token
passes a pair, 2.2x at equal cost per token; xgblora keeps the activations of P + 2C tokens, TRL those of its layer
boundaries and one layer's recompute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xgblora import atomic
from xgblora.bench.dpo import LORA, PreferenceCase, Suite, options, trl_options
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


REWARD = Suite("reward", "pairs", xgblora_run, trl_trainer, __name__)
run, format_table, memory_worker = REWARD.run, REWARD.format_table, REWARD.memory_worker  # the suite's entry points
