"""`xgblora bench --suite dpo`: xgblora's DPO step against TRL's `DPOTrainer` + PEFT LoRA.

Both sides train the same random Llama-shaped model (LoRA r=8, alpha 16, every linear layer of the blocks, no
dropout, fp32 (TRL's default bf16 autocast turned off), AdamW lr 1e-5 constant, clip 1.0, loss sigmoid, beta 0.1,
the reference computed each step with the adapter off: TRL's defaults with PEFT otherwise) on the same pairs:
`--batch_size` pairs a step, every pair a prompt of `--dpo_prompt_len` tokens and two completions of
`--dpo_completion_len` (words that are one token each, so every batch has the same shape on both sides whatever
order they draw it in). One xgblora optimizer step (the call `Trainer.fit` makes) runs inside each TRL
`on_step_end`, so the two alternate step by step (`InterleavedSteps`). Gradient checkpointing as `--checkpointing`
asks, one case each: each side's default (TRL's configs turn it on, xgblora's leave it off: it keeps activations),
or on or off on both sides; the table says which.

Peak memory: each side in its own process, what its steps add to the memory held before them (`bench.sft`).
`--suite kto` (bench/kto.py) and `--suite reward` (bench/reward.py) run the same comparison with KTO's and
RewardTrainer's trainers (`Suite`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xgblora import atomic
from xgblora.bench.flags import checkpointing_cell, checkpointing_ran, checkpointing_sides
from xgblora.bench.memory import (
    first_steps_memory,
    memory_cell,
    run_against_baseline,
    sides_in_subprocesses,
)
from xgblora.bench.sft import chat_tokenizer
from xgblora.bench.timing import InterleavedSteps, against_trainer
from xgblora.config import DPOConfig
from xgblora.data.preference import read_preferences
from xgblora.distributed import LOCAL
from xgblora.models import pretrained
from xgblora.recipes.dpo import DPORun, prepare

DPO_MODELS = ("llama-100m-random",)
LORA = dict(r=8, alpha=16.0)
LR = 1e-5
BETA = 0.1
MEMORY_STEPS = 2
WORDS = ("than", "how")  # one token each after a space in the built-in models' tokenizer


@dataclass(frozen=True)
class PreferenceCase:
    """One comparison: a model and the sizes of a step."""

    model_name: str
    batch: int  # pairs (dpo) or rows (kto) per step
    prompt_len: int  # words (tokens) per prompt
    completion_len: int  # words (tokens) per completion, before EOS
    steps: int  # timed steps, after `warmup` untimed ones
    warmup: int
    device: str = "cpu"
    checkpointing: str = "default"  # a --checkpointing choice


@dataclass(frozen=True)
class Suite:
    """What differs between the preference suites: the name, what a step's batch counts, xgblora's run (with its
    `trainer`) and TRL's trainer on a case's pair file, and the module that defines it (whose `memory_worker` the
    memory subprocesses import); two completions a row either way (DPO's chosen and rejected, KTO's completion and
    its mismatched one). Its methods are a suite module's entry points (`bench.suites`), the same for every
    preference suite."""

    name: str
    unit: str
    ours: Callable[[PreferenceCase, Path, str], Any]
    theirs: Callable[[PreferenceCase, Path, list[Any], str], Any]
    module: str

    def run(self, args: argparse.Namespace) -> list[dict[str, Any]]:
        return run_suite(args, self)

    def format_table(self, results: list[dict[str, Any]]) -> str:
        return suite_table(results, self)

    def memory_worker(self, config: dict[str, Any]) -> dict[str, float]:
        return suite_memory(config, self)


def pair_file(case: PreferenceCase, n: int) -> Path:
    """n pairs of the case's lengths, chosen and rejected different (in a temporary folder)."""
    rng = random.Random(0)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for _ in range(n):
        chosen, rejected = text(case.completion_len), text(case.completion_len)
        while rejected == chosen:
            rejected = text(case.completion_len)
        rows.append({"prompt": text(case.prompt_len), "chosen": " " + chosen, "rejected": " " + rejected})
    path = Path(tempfile.mkdtemp(prefix="xgblora-preference-bench-")) / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def options(case: PreferenceCase, pairs: Path, output_dir: str) -> dict[str, Any]:
    """xgblora's options of a case, for either suite."""
    return dict(model_name=case.model_name, train_file=str(pairs), method="lora",
                lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_target_modules="all-linear", learning_rate=LR,
                lr_scheduler_type="constant", beta=BETA, per_device_train_batch_size=case.batch,
                max_steps=case.warmup + case.steps, max_length=1024, save_strategy="no", device=case.device,
                output_dir=output_dir, seed=0, logging_steps=10**9,
                gradient_checkpointing=checkpointing_sides(case.checkpointing)["xgblora"])


def trl_options(case: PreferenceCase, output_dir: str) -> dict[str, Any]:
    """TRL's config of a case, for any of its trainers: fp32 as xgblora's side (TRL's configs turn bf16 autocast on
    by default, on the CPU too), gradient checkpointing as the case asks; its other defaults stay."""
    return dict(output_dir=output_dir, max_steps=case.warmup + case.steps, per_device_train_batch_size=case.batch,
                learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, beta=BETA, max_length=1024,
                report_to="none", save_strategy="no", logging_steps=10**9, disable_tqdm=True,
                dataloader_num_workers=0, seed=0, use_cpu=pretrained.choose_device(case.device).type == "cpu",
                bf16=False, gradient_checkpointing=checkpointing_sides(case.checkpointing)["trl"])


def xgblora_run(case: PreferenceCase, pairs: Path, output_dir: str) -> DPORun:
    """xgblora's DPO run for the case, as `xgblora dpo` builds it."""
    return prepare(DPOConfig(**options(case, pairs, output_dir)), LOCAL, read_preferences(str(pairs)), [])


def trl_trainer(name: str, case: PreferenceCase, pairs: Path, callbacks: list[Any], output_dir: str) -> Any:
    """TRL's `name`Trainer (DPO, KTO) with PEFT LoRA shaped like xgblora's, on the same pair file (KTOTrainer
    unpairs it, as xgblora kto does)."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    model, _ = pretrained.load(case.model_name, device=case.device)
    rows = atomic.jsonl_rows(pairs.read_text(encoding="utf-8"))
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    return getattr(trl, f"{name}Trainer")(
        model=model, args=getattr(trl, f"{name}Config")(**trl_options(case, output_dir)),
        train_dataset=Dataset.from_list(rows), processing_class=chat_tokenizer(case.model_name), peft_config=lora,
        callbacks=callbacks)


DPO = Suite("dpo", "pairs", xgblora_run, functools.partial(trl_trainer, "DPO"), __name__)


def compare_case(case: PreferenceCase, suite: Suite = DPO) -> dict[str, Any]:
    """TRL and xgblora steps alternating: per-step times and the speed-up."""
    pairs = pair_file(case, case.batch * (case.warmup + case.steps))
    with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as trl_dir:
        ours = suite.ours(case, pairs, ours_dir)
        timer = InterleavedSteps(lambda index: ours.trainer.train_step(), ours.trainer.run.device, case.warmup)
        trainer = suite.theirs(case, pairs, [timer.callback()], trl_dir)
        timer.start()
        trainer.train()
    return {"model_name": case.model_name, suite.unit: case.batch, "prompt_len": case.prompt_len,
            "completion_len": case.completion_len, "gradient_checkpointing": checkpointing_ran(ours.trainer, trainer),
            **against_trainer(timer.trainer_s, timer.ours_s)}


def suite_memory(config: dict[str, Any], suite: Suite) -> dict[str, float]:
    """In a fresh process: one side's first MEMORY_STEPS steps, and the memory they add (MiB)."""
    case = dataclasses.replace(PreferenceCase(**config["case"]), warmup=0, steps=MEMORY_STEPS)
    pairs = pair_file(case, case.batch * MEMORY_STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        return first_steps_memory(config["side"], lambda: suite.ours(case, pairs, tmp).trainer,
                                  lambda: suite.theirs(case, pairs, [], tmp), MEMORY_STEPS,
                                  pretrained.choose_device(case.device))


def cases(args: argparse.Namespace) -> list[PreferenceCase]:
    """Every model the flags ask for, at the flags' sizes."""
    return [PreferenceCase(model_name=m, batch=args.batch_size, prompt_len=args.dpo_prompt_len,
                           completion_len=args.dpo_completion_len, steps=args.repeats, warmup=args.warmup,
                           device=args.device, checkpointing=choice)
            for m in (args.dpo_models or list(DPO_MODELS)) for choice in args.checkpointing]


def run_suite(args: argparse.Namespace, suite: Suite) -> list[dict[str, Any]]:
    """Every case: timing interleaved in this process, memory in subprocesses (the suite module's memory_worker)."""
    def measure_memory(case: PreferenceCase) -> dict[str, Any]:
        return sides_in_subprocesses(suite.module, asdict(case), suite.name.upper())

    return run_against_baseline(suite.name, cases(args), functools.partial(compare_case, suite=suite), measure_memory,
                                functools.partial(suite_table, suite=suite), args.skip_memory)


def suite_table(results: list[dict[str, Any]], suite: Suite) -> str:
    """A Markdown table: one row per model, with the targets' verdicts (1.5x the steps/s, no more memory)."""
    lines = [f"| model | {suite.unit}, prompt + completion tokens | checkpointing xgblora / TRL | xgblora steps/s | "
             f"TRL steps/s | speed-up (median step) | memory added xgblora / TRL (MiB) | >= 1.5x | memory <= TRL |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = memory_cell(r)
        mem_ok = ("pass" if r["mem_added_over_trl"] <= 1.0 else "miss") if "mem_added_over_trl" in r else "n/a"
        lines.append(f"| {r['model_name']} | {r[suite.unit]}, {r['prompt_len']} + 2 x {r['completion_len']} | "
                     f"{checkpointing_cell(r)} | {r['xgblora_steps_per_s']:.3f} | {r['trl_steps_per_s']:.3f} | {r['speedup_vs_trl']:.2f}x "
                     f"({r['speedup_vs_trl_median_step']:.2f}x) | {mem} | "
                     f"{'pass' if r['speedup_vs_trl'] >= 1.5 else 'miss'} | {mem_ok} |")
    return "\n".join(lines)


run, format_table, memory_worker = DPO.run, DPO.format_table, DPO.memory_worker  # the suite's entry points
