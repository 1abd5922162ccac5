"""`xgblora grpo`: online RL with verifiable rewards (GRPO, with TRL's GRPOTrainer's options and defaults) for
full fine-tuning, LoRA and XGBLoRA, under AdamW or MeZO.

Every generation batch: the next generation_batch / G prompts (seeded epochs, resumable) are sampled G times each
by the shared-prefix sampler (the policy, dropout off), the reward functions score the completions, the rewards
become group-normalised advantages, and one pass without gradients gives what the loss needs besides: the old
log-probabilities, when the batch serves more than one optimizer step or MeZO (whose two-point estimate needs the
ratio's value), and the reference ones when beta > 0 (the model as it started: a new adapter switched off, a
continued adapter's starting factors, no second model; a frozen copy under full fine-tuning). The batch is
shuffled by groups and cut into optimizer batches; each optimizer step takes the next (AdamW: in micro-batches,
accumulated; MeZO: the whole optimizer batch, two perturbed forwards), and after num_iterations passes a new batch is
sampled. Under --zo_objective reward (evolution strategies) there is no generation batch: each step's batch is its
prompts and a sampling seed, and the loss of a perturbed policy is minus the rewards of the completions it samples
itself (`PolicyReward`). The loop is `xgblora train`'s (`Trainer`, with `Generations` as its source of batches
and `GRPOLoss` as its loss), so the schedule, XGBLoRA's merges, the NaN policy, evaluation, checkpoints and resume
behave as there.

Under torchrun or accelerate launch the run is data-parallel: every process draws the same prompts and keeps its
share of whole groups, samples them with its own seed, and takes per_device_train_batch_size completions per
micro-batch; rewards are gathered (the batch std of --scale_rewards batch, the logged statistics), dapo divides by
the whole generation batch's tokens, and the steppers average gradients (AdamW) or losses (MeZO) over processes.
The held-out prompts are shared out too. Evolution strategies under --zo_es_spread members share out the population
instead: every process samples all of a step's prompts, with one seed, for its own members, and only the members'
losses are summed over processes (no rewards gathered). Only the main process writes to OUTPUT_DIR; a checkpoint holds every
process's generation batch in flight, so a resume needs the same number of processes.

OUTPUT_DIR/ config.yaml, metrics.jsonl (per logging step: loss, lr, rewards per function and total, accuracy,
completion length, clip ratio, KL, entropy), checkpoints/step-N (exact resume: the generation batch in flight is
saved with the optimizer state), final/ (as `xgblora train`), results.json (held-out pass@1 before and after),
grpo.png and report.html (the curves of metrics.jsonl).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from xgblora import parsing
from xgblora.adapters.lora import adapter_factors, adapter_snapshot, adapters_off
from xgblora.config import GRPOConfig
from xgblora.data import formats
from xgblora.data.collation import TokenSeq, collate
from xgblora.data.order import BatchStream
from xgblora.data.sources import parse_columns
from xgblora.data.splits import Splits
from xgblora.distributed import LOCAL, Distributed, setup
from xgblora.errors import UserError
from xgblora.generation.generate import Prompts, read_prompts, sampling_params
from xgblora.generation.grpo_objective import (
    CompletionBatch,
    GRPOLoss,
    Objective,
    advantages,
    completion_logprobs,
    nanstd,
    normalized_sum,
    reward_scale,
    row_weights,
)
from xgblora.generation.rewards import Rewards
from xgblora.models.sampler import Sample, Sampler, SamplingParams
from xgblora.optim.zo_estimators import spreads_members
from xgblora.report import GRPO_PANELS, write_curves_report
from xgblora.train.loop import Trainer
from xgblora.train.results import write_results
from xgblora.train.run import finished_results, run_folder, start_over
from xgblora.train.setup import Method, RunSetup, autocast_dtype, load_policy, setup_method

log = logging.getLogger("xgblora")
SAMPLES_LOGGED = 4  # completions per logging step under --log_completions


@dataclass
class Generation:
    """One generation batch: its completions, shuffled, as a CompletionBatch; its statistics; a few samples."""

    batch: CompletionBatch
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class PromptBatch:
    """A step's batch under --zo_objective reward: this process's prompts and the sampling seed that every member of
    the population samples them with (common random numbers: two members differ by their weights, not their luck)."""

    indices: list[int]
    seed: int
    prompt_tokens: int

    @property
    def n_examples(self) -> int:
        return len(self.indices)

    def n_tokens(self) -> int:
        return self.prompt_tokens

    def to(self, device: torch.device) -> PromptBatch:  # noqa: ARG002 (the prompts are read where they are sampled)
        return self


class PolicyReward:
    """--zo_objective reward's loss: minus the rewards of the completions that the policy, as it is now (one member
    of the population, perturbed in place by the estimator), samples for the batch's prompts. Evolution strategies
    as Qiu et al. fine-tune LLMs ("Evolution Strategies at Scale", arXiv 2509.24372): perturb, sample, score."""

    def __init__(self, source: Generations):
        self.source, self.model = source, source.model

    def __call__(self, batch: PromptBatch) -> torch.Tensor:
        """Minus the mean reward of the completions that were scored (a reward function's None leaves one out);
        NaN when none was."""
        return -self.source.policy_rewards(batch).nanmean().reshape(1)


class GenerationBuffer:
    """This process's share of the generation batch in flight, the cycle of optimizer steps it serves, and the number
    of generation batches so far; saved with checkpoints (every rank's batch, gathered by the main process) so that
    a resumed run continues it exactly."""

    def __init__(self, dist: Distributed, device: torch.device) -> None:
        self.current: Generation | None = None
        self.cycle, self.generations = -1, 0
        self.dist, self.device = dist, device

    def state_dict(self) -> dict[str, Any]:
        """Every rank's batch in flight, in rank order, and the counters (every rank calls it)."""
        return {"ranks": self.dist.gather_objects(self._own_state()), "cycle": self.cycle,
                "generations": self.generations}

    def _own_state(self) -> dict[str, Any]:
        """The batch's tensors (on the CPU), statistics and samples (empty before the first generation batch)."""
        if self.current is None:
            return {}
        batch = {f.name: getattr(self.current.batch, f.name) for f in dataclasses.fields(self.current.batch)}
        batch = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return {"batch": batch, "metrics": self.current.metrics, "samples": self.current.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's batch and the counters from what state_dict() returned."""
        ranks = state["ranks"]
        if len(ranks) != self.dist.world_size:
            raise UserError(f"this checkpoint holds the generation batches of {len(ranks)} processes; resume it with "
                            f"{len(ranks)} processes, not {self.dist.world_size}")
        own = ranks[self.dist.rank]
        self.current = Generation(CompletionBatch(**own["batch"]).to(self.device), own["metrics"], own["samples"]) \
            if own else None
        self.cycle, self.generations = state["cycle"], state["generations"]


@dataclass
class Plan:
    """How completions are grouped: G per prompt, per generation batch (all processes together), and on each
    process per optimizer step and stepper call."""

    group: int
    generation: int
    step: int
    per_call: int  # completions per next_batch() call: a micro-batch (AdamW) or the optimizer batch (MeZO)
    num_iterations: int
    processes: int = 1

    @classmethod
    def of(cls, cfg: GRPOConfig, processes: int) -> Plan:
        """The plan of cfg over `processes` data-parallel processes; a one-line UserError when its generation batch
        does not split into whole groups and whole optimizer batches per process."""
        plan = cls(cfg.num_return_sequences, cfg.generation_batch(processes), cfg.optimizer_batch,
                   cfg.optimizer_batch if cfg.trainer == "zo" else cfg.per_device_train_batch_size,
                   cfg.num_iterations, processes)
        if plan.prompts % processes:
            raise UserError(f"the generation batch's {plan.prompts} prompts (--generation_batch_size "
                            f"{plan.generation} / --num_generations {plan.group}) do not split evenly over "
                            f"{processes} processes; make the prompt count a multiple of {processes}")
        if plan.generation % (plan.step * processes):
            raise UserError(f"--generation_batch_size {plan.generation} must be a multiple of the optimizer batch "
                            f"of all processes, per_device_train_batch_size x gradient_accumulation_steps x "
                            f"{processes} processes = {plan.step * processes}")
        return plan

    @property
    def prompts(self) -> int:
        """Prompts per generation batch, all processes together."""
        return self.generation // self.group

    @property
    def local(self) -> int:
        """Completions per generation batch on one process."""
        return self.generation // self.processes

    @property
    def steps_per_generation(self) -> int:
        """Optimizer batches per generation batch."""
        return self.local // self.step

    @property
    def cycle(self) -> int:
        """Optimizer steps between two generation batches."""
        return self.steps_per_generation * self.num_iterations


def _prompt_value(example: Any) -> Any:
    """The prompt as TRL hands it to reward functions: a string, or the conversation as a list of messages."""
    if example.messages:
        return [{"role": role, "content": content} for role, content in example.messages]
    return example.prompt


def _completion_value(prompt: Any, text: str) -> Any:
    """A completion as TRL hands it over: a string, or an assistant message after a conversational prompt."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


class Generations:
    """GRPO's training batches (a `BatchSource` of `train/loop.py`'s Trainer): each cycle of optimizer steps samples
    a generation batch from the policy, scores it, and serves it in optimizer batches; also the held-out evaluation
    (greedy pass@1). See the module docstring."""

    def __init__(self, cfg: GRPOConfig, plan: Plan, model: torch.nn.Module, tokenizer: Any, method: Method,
                 rewards: Rewards, statistics: Any, dist: Distributed, reference: torch.nn.Module | None = None):
        # the loss and the old and reference log-probabilities run in the mode this sets (TRL's disable_dropout,
        # off by default as there); sampling always runs without dropout
        self.dropout = not cfg.disable_dropout
        self.cfg, self.plan, self.model, self.tokenizer, self.method, self.rewards, self.dist = \
            cfg, plan, model, tokenizer, method, rewards, dist
        self.statistics = statistics  # the loss's clip ratios, KL and entropy, drained at each logging step
        self.device = next(model.parameters()).device
        self.autocast = autocast_dtype(cfg, self.device)
        self.reference = reference
        # a continued LoRA adapter is the reference itself, as TRL's frozen copy of the starting model: its factors
        # are kept (a fresh adapter is zero, so switching it off is the same reference at no cost)
        self.reference_factors = adapter_snapshot(method.modules) \
            if cfg.beta and cfg.adapter and cfg.method == "lora" else None
        # --zo_es_spread members: every process samples all of a step's prompts, with one seed, for its members
        self.members_spread = spreads_members(cfg, cfg.trainer)
        self.prompts = self._read(cfg.train_file)
        self.heldout = self._read(cfg.eval_file) if cfg.eval_file else None
        self.max_steps = cfg.max_steps if cfg.max_steps > 0 else self.plan.cycle * max(
            1, round(cfg.num_train_epochs * len(self.prompts.ids) / self.plan.prompts))
        self.stream = BatchStream([len(ids) for ids in self.prompts.ids], 1, cfg.seed, group_by_length=False)
        self.buffer = GenerationBuffer(dist, self.device)
        self.components = {"generation": self.buffer}
        self.step = 0
        self.extra_columns: dict[str, list[Any]] = {}  # reward functions' log_extra, for the logged completions
        self.reward_metrics: dict[str, list[float]] = {}  # their log_metric, until the next logging step
        self.population: list[dict[str, float]] = []  # --zo_objective reward: each member's statistics since the log

    @property
    def generations(self) -> int:
        """Generation batches sampled so far."""
        return self.buffer.generations

    def batches(self, step: int) -> Callable[[], CompletionBatch]:
        """The pieces of step's optimizer batch (a new generation batch first when the step starts a cycle)."""
        self.step = step
        if self.cfg.zo_objective == "reward":
            indices = self._next_prompts()
            batch = PromptBatch(indices, self._sampling_seed(step), sum(len(self.prompts.ids[i]) for i in indices))
            return lambda: batch
        cycle, position = divmod(step, self.plan.cycle)
        if self.buffer.current is None or self.buffer.cycle != cycle:
            self.buffer.current, self.buffer.cycle = self.generate(), cycle
        index, size = position % self.plan.steps_per_generation, self.plan.step
        rows = self.buffer.current.batch.split(index * size, (index + 1) * size)
        pieces = iter([rows.split(i, i + self.plan.per_call) for i in range(0, size, self.plan.per_call)])
        return lambda: next(pieces)

    def metrics(self) -> dict[str, Any]:
        """What a logging step adds: the current generation batch's rewards, the loss's statistics since the last
        logging step, the reward functions' log_metric means, a few completions (--log_completions)."""
        if self.cfg.zo_objective == "reward":
            return {**self._population_metrics(), **self._reward_function_metrics()}
        current = self.buffer.current
        record = {**current.metrics, **self._loss_statistics(), **self._reward_function_metrics()}
        return {**record, "samples": current.samples} if current.samples else record

    def _population_metrics(self) -> dict[str, float]:
        """--zo_objective reward: the mean of each statistic over the members since the last logging step, and
        member_reward_std, the std of the members' mean rewards (0: the perturbations changed no answer's reward, so
        the step moved nothing; a larger --zo_eps makes them differ)."""
        members = self.population
        self.population = []
        if self.members_spread:  # each rank holds its own members' statistics
            members = [m for rank in self.dist.gather_objects(members) for m in rank]
        record = {name: sum(m[name] for m in members) / len(members) for name in members[0]}
        return {**record, "member_reward_std": float(torch.tensor([m["reward"] for m in members]).std(correction=0))}

    def _reward_function_metrics(self) -> dict[str, float]:
        """The reward functions' log_metric means since the last logging step."""
        means = {name: sum(v) / len(v) for name, v in self.reward_metrics.items()}
        self.reward_metrics = {}
        return means

    def _loss_statistics(self) -> dict[str, float]:
        """The loss's statistics since the last logging step, means over the ranks."""
        means = self.statistics.drain()
        values = self.dist.all_mean(torch.tensor(list(means.values()), dtype=torch.float64, device=self.device))
        return dict(zip(means, values.tolist(), strict=True))

    def _read(self, source: str) -> Prompts:
        """The prompts of a file; with a correctness reward, each needs a reference answer."""
        prompts = read_prompts(source, self.tokenizer, columns=self.cfg.columns, raw=self.cfg.raw_prompts,
                               max_length=self.cfg.max_length)
        if self.rewards.accuracy_index is not None:
            for example, row in zip(prompts.examples, prompts.rows, strict=True):
                if not example.answers and "reference" not in row:
                    raise UserError(f"{example.source}: no reference answer for --reward_funcs "
                                    f"{self.rewards.names[self.rewards.accuracy_index]} (a completion, response, or "
                                    f"final assistant turn; --columns completion=answer maps yours)")
        return prompts

    # ------------------------------------------------------------------ generation

    def sample(self, prompts: Prompts, indices: list[int], params: SamplingParams) -> list[list[Sample]]:
        """params.num_samples samples of each prompt in indices (the policy, adapter on)."""
        sampler = Sampler(self.model, self.tokenizer.pad_token_id, formats.model_stop_ids(self.model, self.tokenizer),
                          params)
        drawn: dict[int, list[Sample]] = {}
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            for batch, samples in sampler.run([prompts.ids[i] for i in indices]):
                drawn.update(zip(batch, samples, strict=True))
        return [drawn[j] for j in range(len(indices))]

    def score(self, prompts: Prompts, indices: list[int], texts: list[str],
              completion_ids: list[list[int]]) -> torch.Tensor:
        """Rewards [completions, functions] of the completions of the prompts in indices (G each, in order)."""
        group = len(texts) // len(indices)
        mapped = parse_columns(self.cfg.columns)
        prompt_keys = {"prompt", "messages"} | {theirs for theirs, ours in mapped.items()
                                                if ours in ("prompt", "messages")}
        rows = [prompts.rows[i] for i in indices for _ in range(group)]
        examples = [prompts.examples[i] for i in indices for _ in range(group)]
        values = [_prompt_value(ex) for ex in examples]
        columns: dict[str, list[Any]] = {"reference": [ex.answers[0] if ex.answers else None for ex in examples]}
        for key in dict.fromkeys(k for row in rows for k in row if k not in prompt_keys):
            columns[key] = [row.get(key) for row in rows]
        completions = [_completion_value(p, t) for p, t in zip(values, texts, strict=True)]
        hooks = {"trainer_state": self._trainer_state(), "log_extra": self._log_extra, "log_metric": self._log_metric}
        return self.rewards.score(values, completions, completion_ids, {**columns, **hooks},
                                  [ex.source for ex in examples])

    def _trainer_state(self) -> transformers.TrainerState:
        """What TRL hands reward functions as trainer_state (transformers' TrainerState): the step, epoch, budget."""
        epoch = self.stream.epoch + self.stream.cursor / max(1, len(self.prompts.ids))
        return transformers.TrainerState(epoch=epoch, global_step=self.step, max_steps=self.max_steps,
                                         logging_steps=self.cfg.logging_steps, eval_steps=self.cfg.eval_steps,
                                         save_steps=self.cfg.save_steps,
                                         train_batch_size=self.cfg.per_device_train_batch_size)

    def _log_extra(self, column: str, values: list[Any]) -> None:
        """TRL's log_extra: a column of one value per completion, shown beside the logged completions."""
        self.extra_columns[column] = list(values)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric: a scalar, averaged over the logging step and logged with the other metrics (this
        process's values)."""
        self.reward_metrics.setdefault(name, []).append(float(value))

    def generate(self) -> Generation:
        """Sample, score and prepare this process's share of the next generation batch (see the module
        docstring)."""
        cfg, plan, dist = self.cfg, self.plan, self.dist
        indices = self._next_prompts()
        params = dataclasses.replace(sampling_params(cfg), seed=self._sampling_seed(self.buffer.generations))
        texts, ids, truncated = self._completions(indices, params)
        self.extra_columns = {}
        rewards, advantage, metrics = self._rewards(indices, texts, ids, truncated)
        row_prompts = [i for i in indices for _ in range(plan.group)]
        seqs = [TokenSeq(tuple(self.prompts.ids[i]) + tuple(c), len(c), i, 0)
                for i, c in zip(row_prompts, ids, strict=True)]
        tokens = collate(seqs, self.tokenizer.pad_token_id)
        mask = tokens.target_mask & ~truncated[:, None] if cfg.mask_truncated_completions else tokens.target_mask
        batch = CompletionBatch(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                position_ids=tokens.position_ids, target_mask=mask,
                                prompt_id=torch.tensor(row_prompts),
                                prompt_length=torch.tensor([len(self.prompts.ids[i]) for i in row_prompts]),
                                advantages=advantage)
        batch = self._with_logprobs(batch)
        # groups shuffled whole (TRL shuffles rows; the loss is the same sum): a prompt's completions then share
        # its forward in the loss (completion_logprobs)
        groups = torch.randperm(len(indices), generator=torch.Generator().manual_seed(params.seed))
        order = (groups[:, None] * plan.group + torch.arange(plan.group)).flatten()
        batch = batch.rows(order)
        # dapo and cispo divide by the generation batch's tokens on all ranks
        tokens_everywhere = float(self._gathered(mask.sum(1, keepdim=True))[0].sum())
        weights = row_weights(batch.target_mask.cpu(), cfg.loss_type, cfg.max_new_tokens, plan.step,
                              tokens_everywhere, plan.steps_per_generation * dist.world_size,
                              cfg.per_device_train_batch_size)
        logged = [{"prompt": self.prompts.rows[indices[j // plan.group]], "completion": texts[j],
                   "reward": float(rewards[j]), **{k: v[j] for k, v in self.extra_columns.items() if j < len(v)}}
                  for j in range(min(SAMPLES_LOGGED, len(texts)))]
        self.buffer.generations += 1
        return Generation(dataclasses.replace(batch, nll_weight=weights.to(self.device)), metrics,
                          logged if cfg.log_completions else [])

    def policy_rewards(self, batch: PromptBatch) -> torch.Tensor:
        """The total rewards of G completions of each of batch's prompts, sampled now with batch's seed (see
        PolicyReward); the statistics join the population's for the next logging step."""
        params = dataclasses.replace(sampling_params(self.cfg), seed=batch.seed)
        texts, ids, truncated = self._completions(batch.indices, params)
        # spread members: the member's completions are all on this process, and the others score other members
        rewards, _, metrics = self._rewards(batch.indices, texts, ids, truncated, gather=not self.members_spread)
        self.population.append(metrics)
        return rewards.to(self.device)

    def _next_prompts(self) -> list[int]:
        """This rank's share of the next generation batch's prompts: every rank draws the whole batch, so the streams
        stay in step, and keeps its own whole groups (all of them when the ranks share out ES's members instead)."""
        stream = iter(self.stream)
        drawn = [next(stream)[0] for _ in range(self.plan.prompts)]
        return drawn if self.members_spread else drawn[self.dist.rank::self.dist.world_size]

    def _sampling_seed(self, draw: int) -> int:
        """The sampling seed of the draw-th generation batch (--zo_objective reward: of step draw), one per rank; one
        for all when the ranks share out ES's members (a member samples as it would on one process)."""
        world, rank = (1, 0) if self.members_spread else (self.dist.world_size, self.dist.rank)
        return (self.cfg.seed * 1_000_003 + draw) * world + rank

    def _completions(self, indices: list[int],
                     params: SamplingParams) -> tuple[list[str], list[list[int]], torch.Tensor]:
        """Samples of the prompts in indices: their texts, token ids (the stop token included) and which were cut."""
        samples = [s for per_prompt in self.sample(self.prompts, indices, params) for s in per_prompt]
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        ids = [list(s.token_ids) + ([s.stop_id] if s.stop_id is not None else []) for s in samples]
        return texts, ids, torch.tensor([s.finish_reason == "length" for s in samples])

    def _rewards(self, indices: list[int], texts: list[str], ids: list[list[int]], truncated: torch.Tensor,
                 gather: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """This rank's rewards and advantages, and the statistics of the whole generation batch: all from every
        rank's scores (a group lives on one rank, but --scale_rewards batch and the logs need every group); from
        this rank's alone without gather."""
        lengths = torch.tensor([len(c) for c in ids], dtype=torch.float)
        scores = torch.cat([self.score(self.prompts, indices, texts, ids), lengths[:, None],
                            truncated[:, None].float()], 1)
        everyone, start = self._gathered(scores) if gather else (scores, 0)
        per_function, rewards = everyone[:, :-2], self.rewards.total(everyone[:, :-2])
        if torch.isnan(rewards).all():  # nothing to learn from, on any rank: the loss would be 0 to the end
            raise UserError(f"{self.prompts.examples[indices[0]].source}: every reward function "
                            f"({', '.join(self.rewards.names)}) returned None or NaN for all {len(rewards)} "
                            f"completions of generation batch {self.buffer.generations + 1}; nothing to learn from")
        mine = slice(start, start + len(texts))
        if self.cfg.multi_objective_aggregation == "normalize_then_sum":
            shaped = normalized_sum(per_function, self.rewards.weights, self.plan.group)
            group, scale = len(shaped), "batch"
        else:
            shaped, group, scale = rewards, self.plan.group, self.cfg.scale_rewards
        advantage = advantages(shaped, group, scale)[mine]
        metrics = self._generation_metrics(per_function, rewards, reward_scale(shaped, group, scale),
                                           everyone[:, -2], everyone[:, -1].bool())
        return rewards[mine], advantage, metrics

    def _gathered(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's rows in rank order, on the CPU, and where this rank's start."""
        everyone, start = self.dist.gather_rows(rows.to(self.device))
        return everyone.cpu(), start

    def _with_logprobs(self, batch: CompletionBatch) -> CompletionBatch:
        """The old log-probabilities (when the batch serves more than one step, or MeZO) and the reference ones."""
        cfg = self.cfg
        batch = batch.to(self.device)
        old = self._logprobs(self.model, batch) if cfg.trainer == "zo" or self.plan.cycle > 1 else None
        ref = None
        if cfg.beta:
            with self._reference_policy() as reference:
                ref = self._logprobs(reference, batch)
        return dataclasses.replace(batch, old_logps=old, ref_logps=ref)

    @contextlib.contextmanager
    def _reference_policy(self) -> Iterator[torch.nn.Module]:
        """The reference of --beta: the frozen copy (full fine-tuning), the model with the continued adapter's
        starting factors, or the model with its adapter switched off (XGBLoRA: with the boosters merged so far)."""
        if self.reference is not None:
            yield self.reference
        elif self.reference_factors is not None:
            with adapter_factors(self.method.modules, self.reference_factors):
                yield self.model
        else:
            with adapters_off(self.method.modules):
                yield self.model

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: CompletionBatch) -> torch.Tensor:
        size = self.cfg.per_device_eval_batch_size
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            return torch.cat([completion_logprobs(model, batch.split(i, i + size), self.cfg.temperature)[0]
                              for i in range(0, batch.n_examples, size)])

    def _generation_metrics(self, per_function: torch.Tensor, rewards: torch.Tensor, scale: torch.Tensor,
                            lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
        """The statistics of the whole generation batch (every rank's rows), as TRL logs them: unscored completions
        left out of means and stds; frac_reward_zero_std, the share of completions whose advantage's std (scale) is
        0."""
        metrics = {"reward": float(rewards.nanmean()), "reward_std": float(nanstd(rewards))}
        for i, name in enumerate(self.rewards.names):
            metrics[f"rewards/{name}"] = float(per_function[:, i].nanmean())
            metrics[f"rewards/{name}/std"] = float(nanstd(per_function[:, i]))
        metrics.update({"completion_length": float(lengths.mean()),
                        "completions_truncated": float(truncated.float().mean()),
                        "frac_reward_zero_std": float(torch.isclose(scale, torch.zeros_like(scale)).float().mean())})
        if self.rewards.accuracy_index is not None:
            metrics["accuracy"] = float(per_function[:, self.rewards.accuracy_index].nanmean())
        return metrics

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, model: torch.nn.Module, heldout: Sequence[int],  # noqa: ARG002 (the policy samples)
                 demos: Sequence = ()) -> tuple[dict[str, float], list]:  # noqa: ARG002
        """pass@1 of greedy completions of the held-out prompts (the first correctness reward) and their mean reward
        (the Trainer's evaluator: the first metric decides the best step)."""
        indices = list(heldout)[self.dist.rank::self.dist.world_size]  # each rank its share
        per_function = self._gathered(self._greedy_scores(indices) if indices
                                      else torch.empty(0, len(self.rewards.names)))[0]  # more ranks than prompts
        reward = {"reward": float(self.rewards.total(per_function).nanmean())}
        if self.rewards.accuracy_index is None:
            return reward, []
        return {"pass@1": float(per_function[:, self.rewards.accuracy_index].nanmean()), **reward}, []

    def _greedy_scores(self, indices: list[int]) -> torch.Tensor:
        """Rewards [prompts, functions] of a greedy completion of each held-out prompt in indices."""
        params = dataclasses.replace(sampling_params(self.cfg), num_samples=1, temperature=0.0)
        samples = [s[0] for s in self.sample(self.heldout, indices, params)]
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        return self.score(self.heldout, indices, texts, [list(s.token_ids) for s in samples])


def run_grpo(cfg: GRPOConfig) -> dict[str, Any]:
    """`xgblora grpo`: train, then write final/ and results.json (see the module docstring). Under torchrun or
    accelerate launch every process trains on its share of each generation batch; the main one owns the folder."""
    dist = setup(cfg)  # before the model loads: it picks this rank's GPU
    if (done := finished_results(cfg, Path(cfg.output_dir))) is not None:
        return done
    with run_folder(cfg, dist) as out:
        trainer, source = prepare(cfg, dist)
        if cfg.overwrite_output_dir and not cfg.resume_from_checkpoint and dist.is_main:
            start_over(out)
        if dist.is_main:
            parsing.dump(trainer.cfg, out / "config.yaml")
        summary = trainer.fit()
        after = source.evaluate(trainer.run.model, trainer.run.splits.eval)[0] if source.heldout else {}
        results = {"model": trainer.cfg.model_name, "method": cfg.method, "trainer": cfg.trainer,
                   "loss_type": cfg.loss_type, "seed": cfg.seed, "generation_batches": source.generations, **summary,
                   **{f"before_{k}": v for k, v in trainer.state.before.items()},
                   **{f"eval_{k}": v for k, v in after.items()}}
        if dist.is_main:
            write_results(cfg, results)
            write_curves_report(out, results, "grpo", GRPO_PANELS)
    return results


def warn_sequence_level(cfg: GRPOConfig) -> None:
    """Warn, as TRL does, where sequence-level ratios meet a loss that adds up token terms: that is not GSPO's
    objective, which averages each completion's terms (--loss_type grpo)."""
    if cfg.importance_sampling_level == "sequence" and cfg.loss_type != "grpo":
        log.warning("--importance_sampling_level sequence with --loss_type %s: this loss adds up per-token terms, so "
                    "each completion weighs by its length rather than once; GSPO's objective is --loss_type grpo",
                    cfg.loss_type)


def prepare(cfg: GRPOConfig, dist: Distributed = LOCAL) -> tuple[Trainer, Generations]:
    """The run's Trainer, on GRPO's loss and its generation batches (the reward functions and the batch plan
    checked before the model loads)."""
    warn_sequence_level(cfg)
    rewards = Rewards(cfg.reward_funcs, cfg.reward_weights, cfg.answer_tolerance)
    # spread members: every process samples the step's whole batch, as one process would
    plan = Plan.of(cfg, 1 if spreads_members(cfg, cfg.trainer) else dist.world_size)
    template = formats.read_chat_template(cfg.chat_template) if cfg.chat_template else None
    cfg, model, tokenizer = load_policy(cfg, dist, template)
    # full fine-tuning has no adapter to switch off: its reference is a frozen copy (only when beta needs it)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if cfg.method == "ft" and cfg.beta else None
    method = setup_method(model, cfg)
    device = next(model.parameters()).device
    objective = Objective(cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.use_bias_correction_kl, cfg.loss_type,
                          cfg.importance_sampling_level)
    grpo_loss = GRPOLoss(model, objective, cfg.temperature, autocast_dtype(cfg, device), fused=cfg.fused_lm_head)
    source = Generations(cfg, plan, model, tokenizer, method, rewards, grpo_loss.statistics, dist, reference)
    loss_fn = PolicyReward(source) if cfg.zo_objective == "reward" else grpo_loss
    heldout = list(range(len(source.heldout.ids))) if source.heldout else []
    run = RunSetup(cfg, task=None, splits=Splits(train=[], dev=[], eval=heldout, eval_is_own=True), head="lm",
                   model=model, tokenizer=tokenizer, scoring=None, device=device, evaluate=source.evaluate)
    return Trainer(run, method, source, dist, loss_fn=loss_fn), source
