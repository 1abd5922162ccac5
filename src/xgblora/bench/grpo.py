"""`xgblora bench --suite grpo`: xgblora's GRPO step against TRL's `GRPOTrainer` + PEFT LoRA.

Both sides train the same random Llama-shaped model (LoRA r=8, alpha 16, every linear layer of the blocks, no
dropout, fp32 unless --dtype, AdamW lr 1e-5, clip 1.0, beta 0, loss dapo: TRL's defaults) on GSM8K questions as
plain-text prompts, `prompts` of them a step with G = `--num_generations` completions each, up to
`--max_completion_length` tokens at temperature 1, rewarded by the same function (`length_reward`). One step is
everything a step costs: sampling, rewards, advantages, the loss's forward and backward, the update. One xgblora
step runs inside each TRL `on_step_end`, so the two alternate step by step (`timing.InterleavedSteps`).

Peak memory: each side in its own process, what its steps add to the memory held before them (`bench.sft`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from xgblora import atomic
from xgblora.bench.flags import checkpointing_cell, checkpointing_ran, checkpointing_sides
from xgblora.bench.memory import (
    first_steps_memory,
    memory_cell,
    run_against_baseline,
    sides_in_subprocesses,
)
from xgblora.bench.profile import profile_slowest
from xgblora.bench.sft import chat_tokenizer, generated_conversations
from xgblora.bench.timing import InterleavedSteps, against_trainer
from xgblora.config import GRPOConfig
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.recipes.grpo import prepare
from xgblora.train.loop import Trainer

GRPO_MODELS = ("llama-100m-random",)
LORA = dict(r=8, alpha=16.0)
LR = 1e-5
MEMORY_STEPS = 2


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:  # noqa: ARG001
    """The benchmark's reward: the completion's length in characters / 100 (both sides call it the same way)."""
    return [len(c) / 100 for c in completions]


@dataclass(frozen=True)
class GRPOCase:
    """One comparison: a model and the sizes of a step."""

    model_name: str
    prompts: int  # prompts per step
    num_generations: int
    max_completion_length: int
    steps: int  # timed steps, after `warmup` untimed ones
    warmup: int
    dtype: str = "float32"
    device: str = "cpu"
    data_dir: str = ""
    checkpointing: str = "default"  # a --checkpointing choice

    @property
    def completions(self) -> int:
        """Completions per step."""
        return self.prompts * self.num_generations


class PromptCase(Protocol):
    """What `questions` reads of a case (the GRPO suite's and the ES suite's)."""

    prompts: int
    steps: int
    warmup: int
    data_dir: str


def questions(case: PromptCase) -> Path:
    """A JSONL file of the first GSM8K training questions, enough for every step (in a temporary folder); without
    a data_dir, generated GSM8K-shaped questions (the timing depends on lengths, not on the words)."""
    n = case.prompts * (case.warmup + case.steps)
    if case.data_dir:
        source = Path(case.data_dir) / "gsm8k" / "train.jsonl"
        if not source.is_file():
            raise UserError(f"--suite {{grpo,es}} reads GSM8K questions from {source}, which does not exist "
                            f"(pass --data_dir)")
        texts = [row["question"] for row in atomic.jsonl_rows(source.read_text(encoding="utf-8"))[:n]]
    else:
        texts = [example.messages[0][1] for example in generated_conversations(n)]
    path = Path(tempfile.mkdtemp(prefix="xgblora-grpo-bench-")) / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts), encoding="utf-8")
    return path


def xgblora_run(case: GRPOCase, prompts: Path, output_dir: str) -> Trainer:
    """xgblora's GRPO trainer for the case, as `xgblora grpo` builds it (`train_step()` takes one step)."""
    cfg = GRPOConfig(model_name=case.model_name, train_file=str(prompts), raw_prompts=True, method="lora",
                     lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_target_modules="all-linear",
                     learning_rate=LR, num_return_sequences=case.num_generations,
                     max_new_tokens=case.max_completion_length, per_device_train_batch_size=case.completions,
                     reward_funcs=[f"{__name__}:length_reward"], max_steps=case.warmup + case.steps,
                     save_strategy="no", device=case.device, load_float16=False,
                     load_bfloat16=case.dtype == "bfloat16", output_dir=output_dir, seed=0,
                     gradient_checkpointing=checkpointing_sides(case.checkpointing)["xgblora"])
    return prepare(cfg)[0]


def trl_trainer(case: GRPOCase, prompts: Path, callbacks: list[Any], output_dir: str) -> Any:
    """TRL's GRPOTrainer with PEFT LoRA shaped like xgblora's, on the same prompts and reward."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    model, _ = pretrained.load(case.model_name, dtype=case.dtype, device=case.device)
    tokenizer = chat_tokenizer(case.model_name)
    rows = atomic.jsonl_rows(prompts.read_text(encoding="utf-8"))
    config = TRLConfig(
        output_dir=output_dir, max_steps=case.warmup + case.steps, per_device_train_batch_size=case.completions,
        num_generations=case.num_generations, max_completion_length=case.max_completion_length, temperature=1.0,
        learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, report_to="none", save_strategy="no",
        logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        use_cpu=pretrained.choose_device(case.device).type == "cpu", bf16=case.dtype == "bfloat16",
        gradient_checkpointing=checkpointing_sides(case.checkpointing)["trl"])
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    return GRPOTrainer(model=model, reward_funcs=[length_reward], args=config, train_dataset=Dataset.from_list(rows),
                       processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)


def compare_case(case: GRPOCase) -> dict[str, Any]:
    """TRL and xgblora steps alternating: per-step times and the speed-up."""
    prompts = questions(case)
    with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as trl_dir:
        ours = xgblora_run(case, prompts, ours_dir)
        timer = InterleavedSteps(lambda index: ours.train_step(), ours.run.device, case.warmup, alternate=False)
        trainer = trl_trainer(case, prompts, [timer.callback()], trl_dir)
        timer.start()
        trainer.train()
        profile = profile_slowest(timer.ours_s, lambda _: ours.train_step(), ours.run.device)
    return {"model_name": case.model_name, "prompts": case.prompts, "num_generations": case.num_generations,
            "max_completion_length": case.max_completion_length, "gradient_checkpointing": checkpointing_ran(ours, trainer),
            "xgblora_profile": profile,
            **against_trainer(timer.trainer_s, timer.ours_s)}


def memory_worker(config: dict[str, Any]) -> dict[str, float]:
    """In a fresh process: one side's first MEMORY_STEPS steps, and the memory they add (MiB)."""
    case = dataclasses.replace(GRPOCase(**config["case"]), warmup=0, steps=MEMORY_STEPS)
    prompts = questions(case)
    with tempfile.TemporaryDirectory() as tmp:
        return first_steps_memory(config["side"], lambda: xgblora_run(case, prompts, tmp),
                                  lambda: trl_trainer(case, prompts, [], tmp), MEMORY_STEPS,
                                  pretrained.choose_device(case.device))


def measure_case_memory(case: GRPOCase) -> dict[str, Any]:
    """Each side's memory for the case, one subprocess after the other."""
    return sides_in_subprocesses("xgblora.bench.grpo", asdict(case), "GRPO")


def cases(args: argparse.Namespace) -> list[GRPOCase]:
    """Every model the flags ask for, at the flags' sizes."""
    return [GRPOCase(model_name=m, prompts=args.grpo_prompts, num_generations=args.num_generations,
                     max_completion_length=args.max_completion_length, steps=args.repeats, warmup=args.warmup,
                     dtype=args.dtype, device=args.device, data_dir=args.data_dir or "", checkpointing=choice)
            for m in (args.grpo_models or list(GRPO_MODELS)) for choice in args.checkpointing]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case: timing interleaved in this process, memory in subprocesses."""
    if not args.data_dir:
        print("[grpo] no --data_dir: prompts are generated GSM8K-shaped questions (pass --data_dir DIR with "
              "gsm8k/train.jsonl for the real ones)", file=sys.stderr, flush=True)
    return run_against_baseline("grpo", cases(args), compare_case, measure_case_memory, format_table, args.skip_memory)


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per model, with the targets' verdicts (2x the steps/s, no more memory)."""
    lines = ["| model | prompts x G, tokens | checkpointing xgblora / TRL | xgblora steps/s | TRL steps/s | speed-up "
             "(median step) | memory added xgblora / TRL (MiB) | >= 2x | memory <= TRL |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = memory_cell(r)
        mem_ok = ("pass" if r["mem_added_over_trl"] <= 1.0 else "miss") if "mem_added_over_trl" in r else "n/a"
        lines.append(f"| {r['model_name']} | {r['prompts']} x {r['num_generations']}, {r['max_completion_length']} | "
                     f"{checkpointing_cell(r)} | {r['xgblora_steps_per_s']:.3f} | {r['trl_steps_per_s']:.3f} | {r['speedup_vs_trl']:.2f}x "
                     f"({r['speedup_vs_trl_median_step']:.2f}x) | {mem} | "
                     f"{'pass' if r['speedup_vs_trl'] >= 2.0 else 'miss'} | {mem_ok} |")
    return "\n".join(lines)
