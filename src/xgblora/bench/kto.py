"""`xgblora bench --suite kto`: xgblora's KTO step against TRL's `KTOTrainer` + PEFT LoRA, as `--suite dpo` compares
DPO (bench/dpo.py: the same model, LoRA, optimiser, beta and sizes): both sides read the same pair file and unpair it
as TRL does (`--batch_size` rows a step, each a prompt of `--dpo_prompt_len` tokens and a completion of
`--dpo_completion_len`, with its mismatched completion for the KL estimate), the reference computed each step with
the adapter off, loss kto with TRL's defaults.

A KTO row has one completion, so sharing its prompt saves less than a DPO pair's: per row TRL runs prompt +
completion through the policy forward, again under its gradient checkpointing and in the backward (about 4
passes), the mismatched row without gradient (1) and the reference on both (2), 7 passes of P + C tokens; xgblora
runs the prompt once with both completions with gradients (3 passes of P + 2C) and the reference once (1): with
P = 128 and C = 32, 1120 against 768 token passes, 1.46x at equal cost per token.
"""

from __future__ import annotations

import functools
from pathlib import Path

from xgblora.bench.dpo import PreferenceCase, Suite, options, trl_trainer
from xgblora.config import KTOConfig
from xgblora.data.unpaired import read_unpaired
from xgblora.distributed import LOCAL
from xgblora.recipes.kto import KTORun, prepare


def xgblora_run(case: PreferenceCase, pairs: Path, output_dir: str) -> KTORun:
    """xgblora's KTO run for the case, as `xgblora kto` builds it."""
    return prepare(KTOConfig(**options(case, pairs, output_dir)), LOCAL, read_unpaired(str(pairs)), [])


KTO = Suite("kto", "rows", xgblora_run, functools.partial(trl_trainer, "KTO"), __name__)
run, format_table, memory_worker = KTO.run, KTO.format_table, KTO.memory_worker  # the suite's entry points
