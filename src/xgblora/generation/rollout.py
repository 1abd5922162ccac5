"""GRPO's rollout, the four steps between a batch of prompts and what the loss reads: completions sampled from the
policy, scored by the reward functions (with TRL's interface: the prompt and completion as TRL hands them over, the
rows' other columns, trainer_state, log_extra, log_metric), turned into advantages (GRPO's group-normalised ones, or
RLOO's leave-one-out ones with the KL to the reference in the reward), and the old and reference log-probabilities.
Data-parallel: every process scores its own groups, and the scores are gathered for --scale_rewards batch and the
logged statistics (a group lives on one process)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import transformers

from xgblora.adapters.lora import adapter_factors, adapter_snapshot, adapters_off
from xgblora.config import GRPOConfig
from xgblora.data import formats
from xgblora.data.sources import parse_columns
from xgblora.distributed import Distributed
from xgblora.errors import UserError
from xgblora.generation.generate import Prompts
from xgblora.generation.grpo_objective import (
    CompletionBatch,
    advantages,
    completion_logprobs,
    nanstd,
    normalized_sum,
    reward_scale,
    rloo_advantages,
)
from xgblora.generation.rewards import Rewards
from xgblora.generation.tools import Agent, ToolRollout
from xgblora.models.sampler import RowsCallback, Sample, Sampler, SamplingParams
from xgblora.train.setup import Method


@dataclass
class Completions:
    """Completions of some prompts, G per prompt in the prompts' order: their texts, their token ids and which were
    cut off by max_new_tokens; with tools, each one's rollout (its turns, which tokens are the policy's own)."""

    texts: list[str]
    ids: list[list[int]]
    truncated: torch.Tensor
    rollouts: list[ToolRollout] | None = None

    def part(self, start: int, count: int) -> Completions:
        """Completions start .. start + count - 1."""
        rows = slice(start, start + count)
        return Completions(self.texts[rows], self.ids[rows], self.truncated[rows],
                           None if self.rollouts is None else self.rollouts[rows])

    def lengths(self) -> torch.Tensor:
        """Each completion's tokens, the policy's own only (tool turns left out, as TRL counts them)."""
        if self.rollouts is None:
            return torch.tensor([len(c) for c in self.ids], dtype=torch.float)
        return torch.tensor([sum(r.own) for r in self.rollouts], dtype=torch.float)

    def tool_calls(self) -> torch.Tensor:
        """[n, 2]: each completion's tool calls and failed calls (zeros without tools)."""
        if self.rollouts is None:
            return torch.zeros(len(self.ids), 2)
        return torch.tensor([[r.calls, r.failures] for r in self.rollouts], dtype=torch.float)


def _prompt_value(example: Any) -> Any:
    """The prompt as TRL hands it to reward functions: a string, or the conversation as a list of messages."""
    if example.messages:
        return [{"role": role, "content": content} for role, content in example.messages]
    return example.prompt


def _completion_value(prompt: Any, text: str) -> Any:
    """A completion as TRL hands it over: a string, or an assistant message after a conversational prompt."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


class Rollout:
    """Sample, score, advantages and log-probabilities for the policy `model` (see the module docstring); `group`
    completions per prompt. The reference of --beta: `reference` (a frozen copy, under full fine-tuning), the
    continued LoRA adapter's starting factors, else the model with its adapter switched off."""

    def __init__(self, cfg: GRPOConfig, model: torch.nn.Module, tokenizer: Any, method: Method, rewards: Rewards,
                 group: int, dist: Distributed, autocast: torch.dtype | None, reference: torch.nn.Module | None = None,
                 agent: Agent | None = None):
        self.cfg, self.model, self.tokenizer, self.method, self.rewards = cfg, model, tokenizer, method, rewards
        self.group, self.dist, self.autocast, self.reference, self.agent = group, dist, autocast, reference, agent
        self.device = next(model.parameters()).device
        # a continued LoRA adapter is the reference itself, as TRL's frozen copy of the starting model: its factors
        # are kept (a fresh adapter is zero, so switching it off is the same reference at no cost)
        self.reference_factors = adapter_snapshot(method.modules) \
            if cfg.beta and cfg.adapter and cfg.method == "lora" else None
        self.extra_columns: dict[str, list[Any]] = {}  # reward functions' log_extra, for the logged completions
        self.reward_metrics: dict[str, list[float]] = {}  # their log_metric, until the next logging step

    # ------------------------------------------------------------------ sample

    def draw(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int] | None = None,
             on_rows: RowsCallback | None = None) -> list[list[Sample]]:
        """params.num_samples samples of each prompt (the policy, adapter on); seeds and on_rows as Sampler.run's."""
        sampler = Sampler(self.model, self.tokenizer.pad_token_id, formats.model_stop_ids(self.model, self.tokenizer),
                          params)
        drawn: dict[int, list[Sample]] = {}
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            for batch, samples in sampler.run(prompt_ids, seeds=seeds, on_rows=on_rows):
                drawn.update(zip(batch, samples, strict=True))
        return [drawn[j] for j in range(len(prompt_ids))]

    def completions(self, prompts: Prompts, indices: list[int], params: SamplingParams,
                    seeds: list[int] | None = None, on_rows: RowsCallback | None = None) -> Completions:
        """params.num_samples completions of each prompt in indices, their token ids with the stop token (with
        tools: whole rollouts); the reward functions' log_extra columns start over. seeds (one per entry of
        indices) and on_rows (a row's position in indices) as Sampler.run's; not with tools."""
        self.extra_columns = {}
        if self.agent is not None:
            if seeds is not None or on_rows is not None:
                raise ValueError("tool rollouts sample each turn with a seed of its own: no seeds or on_rows")
            return self._rollouts(prompts, indices, params)
        samples = [s for per_prompt in self.draw([prompts.ids[i] for i in indices], params, seeds, on_rows)
                   for s in per_prompt]
        return Completions([self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples],
                           [list(s.token_ids) + ([s.stop_id] if s.stop_id is not None else []) for s in samples],
                           torch.tensor([s.finish_reason == "length" for s in samples]))

    def _rollouts(self, prompts: Prompts, indices: list[int], params: SamplingParams) -> Completions:
        """Rollouts with tools (generation/tools.py): each turn's samples one batch, with a seed of its own."""
        agent, group, turns = self.agent, params.num_samples, iter(range(1 << 30))

        def draw(ids: list[list[int]], per_prompt: int, budget: int) -> list[list[Sample]]:
            seed = params.seed + 7_919 * next(turns)
            return self.draw(ids, replace(params, num_samples=per_prompt, max_new_tokens=budget, seed=seed))

        def render(example: Any) -> list[int]:
            return formats.generation_prompt_ids(self.tokenizer, example, raw=self.cfg.raw_prompts,
                                                 tools=agent.toolbox.schemas)

        environments, starts = agent.environments([prompts.rows[i] for i in indices],
                                                  [prompts.examples[i] for i in indices], group, render)
        done = agent.run([prompts.ids[i] for i in indices], group, draw, environments, starts).rollouts
        return Completions([self.tokenizer.decode(r.ids, skip_special_tokens=True) for r in done],
                           [r.ids for r in done], torch.tensor([r.truncated for r in done]), done)

    # ------------------------------------------------------------------ score

    def score(self, prompts: Prompts, indices: list[int], done: Completions,
              state: transformers.TrainerState) -> torch.Tensor:
        """Rewards [completions, functions] of the completions of the prompts in indices (G each, in order); `state`
        is what the reward functions get as trainer_state."""
        group = len(done.texts) // len(indices)
        mapped = parse_columns(self.cfg.columns)
        prompt_keys = {"prompt", "messages"} | {theirs for theirs, ours in mapped.items()
                                                if ours in ("prompt", "messages")}
        rows = [prompts.rows[i] for i in indices for _ in range(group)]
        examples = [prompts.examples[i] for i in indices for _ in range(group)]
        values = [_prompt_value(ex) for ex in examples]
        columns: dict[str, list[Any]] = {"reference": [ex.answers[0] if ex.answers else None for ex in examples]}
        for key in dict.fromkeys(k for row in rows for k in row if k not in prompt_keys):
            columns[key] = [row.get(key) for row in rows]
        completions = [_completion_value(p, t) for p, t in zip(values, done.texts, strict=True)]
        if done.rollouts is not None:  # the turns themselves, as TRL hands them over after tool calls
            completions = [r.messages if isinstance(p, list) else c
                           for p, c, r in zip(values, completions, done.rollouts, strict=True)]
            if self.agent.toolbox.factory is not None:
                columns["environments"] = [r.environment for r in done.rollouts]
        hooks = {"trainer_state": state, "log_extra": self._log_extra, "log_metric": self._log_metric}
        return self.rewards.score(values, completions, done.ids, {**columns, **hooks},
                                  [ex.source for ex in examples])

    def _log_extra(self, column: str, values: list[Any]) -> None:
        """TRL's log_extra: a column of one value per completion, shown beside the logged completions."""
        self.extra_columns[column] = list(values)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric: a scalar, averaged over the logging step and logged with the other metrics (this
        process's values)."""
        self.reward_metrics.setdefault(name, []).append(float(value))

    def reward_function_metrics(self) -> dict[str, float]:
        """The reward functions' log_metric means since the last call."""
        means = {name: sum(v) / len(v) for name, v in self.reward_metrics.items()}
        self.reward_metrics = {}
        return means

    # ------------------------------------------------------------------ advantages

    def rewarded(self, prompts: Prompts, indices: list[int], done: Completions, state: transformers.TrainerState,
                 generation: int, gather: bool = True, kl: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """This process's total rewards and advantages, and the statistics of the whole generation batch (number
        `generation`): all from every process's scores; from this process's alone without gather. kl: RLOO's, each
        completion's summed log-ratio to the reference and its tokens [n, 2], which --beta takes off its reward."""
        lengths = done.lengths()
        scores = torch.cat([self.score(prompts, indices, done, state), done.tool_calls(),
                            torch.zeros(len(lengths), 2) if kl is None else kl.cpu(), lengths[:, None],
                            done.truncated[:, None].float()], 1)
        everyone, start = self.gathered(scores) if gather else (scores, 0)
        per_function, rewards = everyone[:, :-6], self.rewards.total(everyone[:, :-6])
        if torch.isnan(rewards).all():  # nothing to learn from, on any process: the loss would be 0 to the end
            raise UserError(f"{prompts.examples[indices[0]].source}: every reward function "
                            f"({', '.join(self.rewards.names)}) returned None or NaN for all {len(rewards)} "
                            f"completions of generation batch {generation}; nothing to learn from")
        mine = slice(start, start + len(done.texts))
        advantage, scale = self._advantages(per_function, rewards, everyone[:, -4])
        metrics = self._generation_metrics(per_function, rewards, scale, everyone[:, -2], everyone[:, -1].bool())
        if kl is not None:  # RLOO's KL in the reward: per token of the batch, as TRL logs it
            metrics["kl"] = float(everyone[:, -4].sum() / everyone[:, -3].sum().clamp(min=1))
        if self.agent is not None:  # TRL's: calls per rollout, failures per call
            calls, failures = everyone[:, -6].sum(), everyone[:, -5].sum()
            metrics["tools/call_frequency"] = float(calls / len(everyone))
            metrics["tools/failure_frequency"] = float(failures / calls) if calls else 0.0
        return rewards[mine], advantage[mine], metrics

    def _advantages(self, per_function: torch.Tensor, rewards: torch.Tensor,
                    kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The advantages of the whole generation batch and the std of each one's group of rewards (for
        frac_reward_zero_std): GRPO's (module grpo_objective), or RLOO's (its rewards clipped, less beta times the
        summed KL)."""
        cfg = self.cfg
        if cfg.advantage_estimator == "rloo":
            shaped = rewards.clamp(*cfg.reward_clip_range) if cfg.reward_clip_range else rewards
            shaped = shaped - cfg.beta * kl
            return rloo_advantages(shaped, self.group, cfg.normalize_advantages), reward_scale(shaped, self.group)
        if cfg.multi_objective_aggregation == "normalize_then_sum":
            shaped = normalized_sum(per_function, self.rewards.weights, self.group)
            group, scale = len(shaped), "batch"
        else:
            shaped, group, scale = rewards, self.group, cfg.scale_rewards
        return advantages(shaped, group, scale), reward_scale(shaped, group, scale)

    def gathered(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every process's rows in rank order, on the CPU, and where this process's start."""
        everyone, start = self.dist.gather_rows(rows.to(self.device))
        return everyone.cpu(), start

    def _generation_metrics(self, per_function: torch.Tensor, rewards: torch.Tensor, scale: torch.Tensor,
                            lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
        """The statistics of the whole generation batch (every process's rows), as TRL logs them: unscored
        completions left out of means and stds; frac_reward_zero_std, the share of completions whose advantage's
        std (scale) is 0."""
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

    # ------------------------------------------------------------------ log-probabilities

    @staticmethod
    def kl_sums(batch: CompletionBatch) -> torch.Tensor:
        """RLOO's KL of each completion [n, 2]: sum_t (old_t - ref_t) over its tokens (first-order, as TRL's
        RLOOTrainer), and its tokens."""
        mask = batch.target_mask
        return torch.stack([((batch.old_logps - batch.ref_logps) * mask).sum(1), mask.sum(1).float()], 1)

    def with_logprobs(self, batch: CompletionBatch, old: bool) -> CompletionBatch:
        """The batch on the device with the old log-probabilities (when `old`: the batch serves more than one step,
        or MeZO) and, when --beta asks, the reference ones."""
        batch = batch.to(self.device)
        old_logps = self._logprobs(self.model, batch) if old else None
        ref = None
        if self.cfg.beta:
            with self._reference_policy() as reference:
                ref = self._logprobs(reference, batch)
        return replace(batch, old_logps=old_logps, ref_logps=ref)

    @contextlib.contextmanager
    def _reference_policy(self) -> Iterator[torch.nn.Module]:
        """The reference of --beta (see the class docstring; XGBLoRA's: with the boosters merged so far)."""
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
