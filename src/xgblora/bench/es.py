"""`xgblora bench --suite es`: evolution strategies on the reward (`xgblora grpo --trainer zo --zo_objective reward
--zo_estimator es`) with the population sampled one member at a time against `--es_member_batch` members at a time
(`--zo_member_batch`: one batched generation, each row on its own member's perturbed adapter).

Both sides train the same model (LoRA r=1 on q/v, `--es_population` independent members, eps 5e-2, lr 2.5e-2) on
the GRPO suite's prompts: `--grpo_prompts` GSM8K questions a step, G = `--num_generations` completions each at
temperature 1 (G = 1: one greedy answer, as the paper scores members), up to `--max_completion_length` tokens,
rewarded by the GRPO suite's `length_reward`. A step is
everything it costs: every member's sampling and rewards, the z-scores, the update. The two sides' steps alternate;
each side's members draw the same per-prompt seeds, so both sample the same answers to float rounding (a sampled
token near a boundary of the inverse CDF can flip; greedy answers only at a near-tie): `same_rewards` says whether
every step's loss, minus the members' mean reward, agreed. On CUDA, the memory a step
allocates above what was held before it (the batched side holds K members' rows at once).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from xgblora.bench.grpo import GRPO_MODELS, length_reward, questions
from xgblora.bench.memory import run_against_baseline
from xgblora.bench.timing import step_stats, sync_device
from xgblora.config import GRPOConfig
from xgblora.recipes.grpo import prepare
from xgblora.train.loop import Trainer


@dataclass(frozen=True)
class ESCase:
    """One comparison: a model, the sizes of a step, the population and the members per generation."""

    model_name: str
    prompts: int
    num_generations: int
    max_completion_length: int
    population: int
    member_batch: int
    steps: int  # timed steps, after `warmup` untimed ones
    warmup: int
    dtype: str = "float32"
    device: str = "cpu"
    data_dir: str = ""


def es_trainer(case: ESCase, prompts: str, output_dir: str, member_batch: int) -> Trainer:
    """The ES run `xgblora grpo` builds for the case, sampling member_batch members at a time."""
    cfg = GRPOConfig(model_name=case.model_name, train_file=prompts, raw_prompts=True, method="lora", lora_r=1,
                     lora_target_modules="q_proj,v_proj", trainer="zo", zo_objective="reward", zo_estimator="es",
                     zo_es_sampling="independent", zo_queries=case.population, zo_eps=5e-2, learning_rate=2.5e-2,
                     zo_member_batch=member_batch, num_return_sequences=case.num_generations,
                     temperature=0.0 if case.num_generations == 1 else 1.0,
                     max_new_tokens=case.max_completion_length,
                     per_device_train_batch_size=case.prompts * case.num_generations,
                     reward_funcs=[f"{length_reward.__module__}:length_reward"], max_steps=case.warmup + case.steps,
                     logging_steps=1, save_strategy="no", device=case.device, load_float16=False,
                     load_bfloat16=case.dtype == "bfloat16", output_dir=output_dir, seed=0, report_to="none")
    return prepare(cfg)[0]


def compare_case(case: ESCase) -> dict[str, Any]:
    """The two sides' steps alternating: per-step seconds (and CUDA memory per step) of each, the speed-up."""
    prompts = str(questions(case))
    with tempfile.TemporaryDirectory() as one_dir, tempfile.TemporaryDirectory() as batched_dir:
        sides = {"one": es_trainer(case, prompts, one_dir, 1),
                 "batched": es_trainer(case, prompts, batched_dir, case.member_batch)}
        device = sides["one"].run.device
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        memory: dict[str, list[float]] = {name: [] for name in sides}
        losses: dict[str, list[float]] = {name: [] for name in sides}
        for step in range(case.warmup + case.steps):
            for name, trainer in sides.items():
                taken, added, loss = _timed_step(trainer, device)
                losses[name].append(loss)
                if step >= case.warmup:
                    seconds[name].append(taken)
                    memory[name].append(added)
    one, batched = step_stats(seconds["one"]), step_stats(seconds["batched"])
    return {"model_name": case.model_name, "prompts": case.prompts, "num_generations": case.num_generations,
            "max_completion_length": case.max_completion_length, "population": case.population,
            "member_batch": case.member_batch, "one_step_stats": one, "batched_step_stats": batched,
            "speedup": one["mean_s"] / batched["mean_s"], "losses": losses,
            "same_rewards": all(abs(a - b) <= 1e-6 * max(1.0, abs(a))
                                for a, b in zip(losses["one"], losses["batched"], strict=True)),
            **({f"{name}_step_mem_mib": max(values) for name, values in memory.items()} if device.type == "cuda"
               else {})}


def _timed_step(trainer: Trainer, device: torch.device) -> tuple[float, float, float]:
    """One step's seconds, on CUDA the MiB it allocated above what was held before it (0 elsewhere), and its loss
    (minus the population's mean reward)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device) if cuda else 0
    sync_device(device)
    start = time.perf_counter()
    loss, _ = trainer.train_step()
    sync_device(device)
    taken = time.perf_counter() - start
    added = (torch.cuda.max_memory_allocated(device) - held) / 2**20 if cuda else 0.0
    return taken, added, float(loss)


def cases(args: argparse.Namespace) -> list[ESCase]:
    """Every model the flags ask for, at the flags' sizes."""
    return [ESCase(model_name=m, prompts=args.grpo_prompts, num_generations=args.num_generations,
                   max_completion_length=args.max_completion_length, population=args.es_population,
                   member_batch=args.es_member_batch, steps=args.repeats, warmup=args.warmup, dtype=args.dtype,
                   device=args.device, data_dir=args.data_dir or "")
            for m in (args.grpo_models or list(GRPO_MODELS))]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case, timed in this process (the two sides are one library's: no baseline process to measure)."""
    return run_against_baseline("es", cases(args), compare_case, None, format_table, skip_memory=True)


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per model."""
    lines = ["| model | prompts x G, tokens | members, per generation | s/step, one at a time | s/step, batched | "
             "speed-up | same rewards | step memory one / batched (MiB, CUDA) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        memory = f"{r['one_step_mem_mib']:,.0f} / {r['batched_step_mem_mib']:,.0f}" if "one_step_mem_mib" in r \
            else "n/a"
        lines.append(f"| {r['model_name']} | {r['prompts']} x {r['num_generations']}, {r['max_completion_length']} | "
                     f"{r['population']}, {r['member_batch']} | {r['one_step_stats']['mean_s']:.3f} | "
                     f"{r['batched_step_stats']['mean_s']:.3f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['same_rewards'] else 'no'} | {memory} |")
    return "\n".join(lines)
