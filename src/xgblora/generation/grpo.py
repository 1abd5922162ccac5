"""`xgblora grpo`: online RL with verifiable rewards (GRPO, with TRL's GRPOTrainer's options and defaults) for
full fine-tuning, LoRA and XGBLoRA, under AdamW or MeZO.

Every generation batch: the next generation_batch / G prompts (seeded epochs, resumable) are sampled G times each
by the shared-prefix sampler (the policy, dropout off), the reward functions score the completions, the rewards
become group-normalised advantages, and one pass without gradients gives what the loss needs besides: the old
log-probabilities, when the batch serves more than one optimizer step or MeZO (whose two-point estimate needs the
ratio's value), and the reference ones when beta > 0 (the model as it started: a new adapter switched off, a
continued adapter's starting factors, no second model; a frozen copy under full fine-tuning). The batch is shuffled by groups and cut into optimizer batches; each optimizer step
takes the next (AdamW: in micro-batches, accumulated; MeZO: the whole optimizer batch, two perturbed forwards), and
after num_iterations passes a new batch is sampled. XGBLoRA merges its boosters on its schedule meanwhile.

Under torchrun or accelerate launch the run is data-parallel: every process draws the same prompts and keeps its
share of whole groups, samples them with its own seed, and takes per_device_train_batch_size completions per
micro-batch; rewards are gathered (the batch std of --scale_rewards batch, the logged statistics), dapo divides by
the whole generation batch's tokens, and the steppers average gradients (AdamW) or losses (MeZO) over processes.
The held-out prompts are shared out too. Only the main process writes to OUTPUT_DIR; a checkpoint holds every
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
import functools
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from xgblora import atomic, perf
from xgblora import config as config_mod
from xgblora.adapters import trained
from xgblora.adapters.lora import adapter_factors, adapter_snapshot, adapters_off
from xgblora.checkpoint import Checkpointer, prune
from xgblora.config import GRPOConfig
from xgblora.data import formats
from xgblora.data.collation import TokenSeq, collate
from xgblora.data.order import BatchStream
from xgblora.data.sources import parse_columns
from xgblora.distributed import LOCAL, Distributed, SilentLog, setup
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
from xgblora.logs import MetricsLog
from xgblora.models import pretrained
from xgblora.models.sampler import Sample, Sampler, SamplingParams
from xgblora.optim.schedule import Schedule
from xgblora.report import write_grpo_report
from xgblora.trackers import open_trackers, parse_report_to
from xgblora.train.lock import run_lock
from xgblora.train.loop import LossWindow, StopRequested, build_stepper, graceful_stop
from xgblora.train.results import save_final, write_adapter, write_results
from xgblora.train.setup import autocast_dtype, setup_method

log = logging.getLogger("xgblora")
SAMPLES_LOGGED = 4  # completions per logging step under --log_completions


@dataclass
class Generation:
    """One generation batch: its completions, shuffled, as a CompletionBatch; its statistics; a few samples."""

    batch: CompletionBatch
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)


class GenerationBuffer:
    """This process's share of the generation batch in flight, saved with checkpoints (every rank's, gathered by
    the main process) so that a resumed run continues it exactly."""

    def __init__(self, dist: Distributed, device: torch.device) -> None:
        self.current: Generation | None = None
        self.dist, self.device = dist, device

    def state_dict(self) -> dict[str, Any]:
        """Every rank's batch in flight, in rank order (every rank calls it)."""
        return {"ranks": self.dist.gather_objects(self._own_state())}

    def _own_state(self) -> dict[str, Any]:
        """The batch's tensors (on the CPU), statistics and samples (empty between generation batches)."""
        if self.current is None:
            return {}
        batch = {f.name: getattr(self.current.batch, f.name) for f in dataclasses.fields(self.current.batch)}
        batch = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return {"batch": batch, "metrics": self.current.metrics, "samples": self.current.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's batch from what state_dict() returned."""
        ranks = state.get("ranks", [state])  # a checkpoint without "ranks" holds one process's batch
        if len(ranks) != self.dist.world_size:
            raise UserError(f"this checkpoint holds the generation batches of {len(ranks)} processes; resume it with "
                            f"{len(ranks)} processes, not {self.dist.world_size}")
        own = ranks[self.dist.rank]
        self.current = Generation(CompletionBatch(**own["batch"]).to(self.device), own["metrics"], own["samples"]) \
            if own else None


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


def load_policy(cfg: GRPOConfig, dist: Distributed = LOCAL) -> tuple[GRPOConfig, torch.nn.Module, Any]:
    """The model to train and its tokenizer (a run or adapter folder names its base), and the config resolved
    against them (the device: this rank's GPU under torchrun; max_length within the model's positions)."""
    source = trained.resolve(cfg.model_name, cfg.adapter)
    cfg = dataclasses.replace(cfg, model_name=source.base, adapter=str(source.adapter) if source.adapter else None)
    device = pretrained.choose_device(dist.device or cfg.device)
    template = formats.read_chat_template(cfg.chat_template) if cfg.chat_template else None
    model, tokenizer = pretrained.load(cfg.model_name, dtype=cfg.dtype_name,
                                       attn_implementation=cfg.attn_implementation, device=str(device),
                                       trust_remote_code=cfg.trust_remote_code, load_in_4bit=cfg.load_in_4bit)
    if template is not None:
        tokenizer.chat_template = template
    max_length = min(cfg.max_length, getattr(model.config, "max_position_embeddings", cfg.max_length))
    return dataclasses.replace(cfg, max_length=max_length, device=str(device)), model, tokenizer


class GRPORun:
    """The state of one GRPO run (model, method, stepper, prompts, rewards, the generation batch in flight) and its
    loop, `fit()`."""

    def __init__(self, cfg: GRPOConfig, dist: Distributed = LOCAL):
        transformers.set_seed(cfg.seed)
        self.dist = dist
        self.plan = Plan.of(cfg, dist.world_size)
        self.rewards = Rewards(cfg.reward_funcs, cfg.reward_weights, cfg.answer_tolerance)  # its errors come first
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer = load_policy(cfg, dist)
        self.device = next(model.parameters()).device
        self.out = Path(cfg.output_dir)
        if dist.is_main:
            config_mod.dump(cfg, self.out / "config.yaml")
        # full fine-tuning has no adapter to switch off: its reference is a frozen copy (only when beta needs it)
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) \
            if cfg.method == "ft" and cfg.beta else None
        self.method = setup_method(self.model, cfg)
        # a continued LoRA adapter is the reference itself, as TRL's frozen copy of the starting model: its factors
        # are kept (a fresh adapter is zero, so switching it off is the same reference at no cost)
        self.reference_factors = adapter_snapshot(self.method.modules) \
            if cfg.beta and cfg.adapter and cfg.method == "lora" else None
        self.model.eval()  # dropout off: the old, new and perturbed log-probabilities come from one function
        self.autocast = autocast_dtype(cfg, self.device)
        self.prompts = self._read(cfg.train_file)
        self.heldout = self._read(cfg.eval_file) if cfg.eval_file else None
        self.max_steps = cfg.max_steps if cfg.max_steps > 0 else self.plan.cycle * max(
            1, round(cfg.num_train_epochs * len(self.prompts.ids) / self.plan.prompts))
        objective = Objective(cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.use_bias_correction_kl, cfg.loss_type,
                              cfg.importance_sampling_level)
        self.loss_fn = GRPOLoss(self.model, objective, cfg.temperature, self.autocast)
        self.stepper = build_stepper(cfg, self.method, self.loss_fn, dist, self.device)
        boosting = self.method.boosting
        if boosting is not None:
            boosting.plan(cfg.booster_steps(self.max_steps), self.max_steps)
        self.schedule = Schedule(cfg.lr_scheduler_type, cfg.learning_rate, self.max_steps,
                                 cfg.warmup_steps or int(cfg.warmup_ratio * self.max_steps))
        self.stream = BatchStream([len(ids) for ids in self.prompts.ids], 1, cfg.seed, group_by_length=False)
        self.buffer = GenerationBuffer(dist, self.device)
        self.window = LossWindow(self.device)
        self.step, self.generations, self.resumes, self.earlier_s = 0, 0, 0, 0.0
        self.extra_columns: dict[str, list[Any]] = {}  # reward functions' log_extra, for the logged completions
        self.reward_metrics: dict[str, list[float]] = {}  # their log_metric, until the next logging step
        self.before: dict[str, float] = {}
        self.checkpointer = self._checkpointer()
        if cfg.resume_from_checkpoint:
            path, state = self.checkpointer.restore(cfg.resume_from_checkpoint)
            self.load_state_dict(state)
            log.info("resumed from %s at step %d", path, self.step)

    def _checkpointer(self) -> Checkpointer:
        boosting = self.method.boosting  # merged boosters live in the base weights
        return Checkpointer(
            self.out / "checkpoints", model=self.model,
            tensors=lambda: self.method.trainable_state(with_bases=boosting is not None),
            components={"stepper": self.stepper, "generation": self.buffer},
            model_components={"boosting": boosting} if boosting is not None else {},
            save_only_model=self.cfg.save_only_model, is_main=self.dist.is_main,
            write_adapter=functools.partial(write_adapter, self.cfg, self.method) if self.method.modules else None)

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

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The loop state as JSON values (the generation batch in flight is the `generation` component)."""
        return {"step": self.step, "epoch": self.stream.epoch, "cursor": self.stream.cursor,
                "generations": self.generations, "window": self.window.state_dict(), "before": self.before,
                "runtime_s": self.earlier_s + time.perf_counter() - self.started, "resumes": self.resumes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""
        self.step, self.generations, self.before = state["step"], state["generations"], state["before"]
        self.stream.epoch, self.stream.cursor = state["epoch"], state["cursor"]
        self.window.load_state_dict(state["window"])
        self.earlier_s, self.resumes = state["runtime_s"], state["resumes"] + 1

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
        stream = iter(self.stream)
        # every rank draws the whole batch, so the streams stay in step, and keeps its own whole groups
        indices = [next(stream)[0] for _ in range(plan.prompts)][dist.rank::dist.world_size]
        seed = (cfg.seed * 1_000_003 + self.generations) * dist.world_size + dist.rank  # one stream per rank
        params = dataclasses.replace(sampling_params(cfg), seed=seed)
        samples = [s for per_prompt in self.sample(self.prompts, indices, params) for s in per_prompt]
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        ids = [list(s.token_ids) + ([s.stop_id] if s.stop_id is not None else []) for s in samples]
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
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
        self.generations += 1
        return Generation(dataclasses.replace(batch, nll_weight=weights.to(self.device)), metrics,
                          logged if cfg.log_completions else [])

    def _rewards(self, indices: list[int], texts: list[str], ids: list[list[int]],
                 truncated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """This rank's rewards and advantages, and the statistics of the whole generation batch: all from every
        rank's scores (a group lives on one rank, but --scale_rewards batch and the logs need every group)."""
        lengths = torch.tensor([len(c) for c in ids], dtype=torch.float)
        scores = torch.cat([self.score(self.prompts, indices, texts, ids), lengths[:, None],
                            truncated[:, None].float()], 1)
        everyone, start = self._gathered(scores)
        per_function, rewards = everyone[:, :-2], self.rewards.total(everyone[:, :-2])
        if torch.isnan(rewards).all():  # nothing to learn from, on any rank: the loss would be 0 to the end
            raise UserError(f"{self.prompts.examples[indices[0]].source}: every reward function "
                            f"({', '.join(self.rewards.names)}) returned None or NaN for all {len(rewards)} "
                            f"completions of generation batch {self.generations + 1}; nothing to learn from")
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
        size = self.cfg.per_device_train_batch_size
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

    def evaluate(self) -> dict[str, float]:
        """pass@1 of greedy completions of the held-out prompts (the first correctness reward), and their mean
        reward; empty without --eval_file."""
        if self.heldout is None:
            return {}
        indices = list(range(len(self.heldout.ids)))[self.dist.rank::self.dist.world_size]  # each rank its share
        per_function = self._gathered(self._greedy_scores(indices) if indices
                                      else torch.empty(0, len(self.rewards.names)))[0]  # more ranks than prompts
        metrics = {"eval_reward": float(self.rewards.total(per_function).nanmean())}
        if self.rewards.accuracy_index is not None:
            metrics["eval_pass@1"] = float(per_function[:, self.rewards.accuracy_index].nanmean())
        return metrics

    def _greedy_scores(self, indices: list[int]) -> torch.Tensor:
        """Rewards [prompts, functions] of a greedy completion of each held-out prompt in indices."""
        params = dataclasses.replace(sampling_params(self.cfg), num_samples=1, temperature=0.0)
        samples = [s[0] for s in self.sample(self.heldout, indices, params)]
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        return self.score(self.heldout, indices, texts, [list(s.token_ids) for s in samples])

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Evaluate, train to max_steps (or a stop signal), evaluate; return the run's statistics."""
        cfg = self.cfg
        if self.step == 0:
            self.before = self.evaluate()
            if self.before:
                log.info("held-out before training: %s", _fmt(self.before))
        self.started = time.perf_counter()
        with graceful_stop() as stop, self._metrics_log() as self.metrics, \
                tqdm(total=self.max_steps, initial=self.step, desc=f"grpo {cfg.method}/{cfg.trainer}",
                     dynamic_ncols=True, disable=None if self.dist.is_main else True) as progress:
            if self.step == 0 and self.before:
                self.metrics.log({"step": 0, **self.before})
            while self.step < self.max_steps:
                loss, lr = self.train_step()
                self.window.add(loss)
                self._boost()
                if self.step % cfg.logging_steps == 0 or self.step == self.max_steps:
                    progress.set_postfix(self._log(lr), refresh=False)
                progress.update(1)
                if cfg.evaluation_strategy == "steps" and self.step % cfg.eval_steps == 0:
                    self.metrics.log({"step": self.step, **self.evaluate()})
                if cfg.save_strategy == "steps" and self.step % cfg.save_steps == 0 and self.step < self.max_steps:
                    self._save()
                if self.dist.end_step(stop["stop"]):  # all ranks stop at the same step
                    path = self._save()
                    raise StopRequested(f"stopped at step {self.step}; checkpoint saved to {path}; resume with "
                                        f"--resume_from_checkpoint latest")
        runtime = self.earlier_s + time.perf_counter() - self.started
        if self.dist.is_main:
            save_final(cfg, self.model, self.tokenizer, self.method)
        after = self.evaluate()
        return {"model": cfg.model_name, "method": cfg.method, "trainer": cfg.trainer, "loss_type": cfg.loss_type,
                "steps": self.step, "generation_batches": self.generations, "seed": cfg.seed,
                "train_runtime_s": round(runtime, 3), "steps_per_second": round(self.step / runtime, 4),
                "resumes": self.resumes, "peak_memory_mb": round(perf.peak_memory_mb(self.device), 1),
                "boosters": len(self.method.boosting.history) if self.method.boosting is not None else 0,
                **{f"before_{k}": v for k, v in self.before.items()}, **after, **self.dist.summary()}

    def _metrics_log(self) -> MetricsLog | SilentLog:
        """metrics.jsonl and the trackers, on the main process; the others' records are dropped."""
        if not self.dist.is_main:
            return SilentLog()
        resume_step = self.step or None
        trackers = open_trackers(parse_report_to(self.cfg.report_to), self.out, self.out.name,
                                 dataclasses.asdict(self.cfg), resume_step)
        return MetricsLog(self.out / "metrics.jsonl", trackers=trackers, resume=self.step > 0,
                          resume_step=resume_step)

    def train_step(self) -> tuple[torch.Tensor, float]:
        """One optimizer step (a new generation batch first when the last one is used up): its loss and lr."""
        position = self.step % self.plan.cycle
        if position == 0 or self.buffer.current is None:
            self.buffer.current = self.generate()
        lr = self.schedule(self.step)
        loss = self._step(self.buffer.current.batch, position % self.plan.steps_per_generation, lr)
        self.step += 1
        return loss, lr

    def _step(self, batch: CompletionBatch, index: int, lr: float) -> torch.Tensor:
        """One optimizer step on the index-th optimizer batch of the generation batch."""
        rows = batch.split(index * self.plan.step, (index + 1) * self.plan.step)
        pieces = iter([rows.split(i, i + self.plan.per_call) for i in range(0, self.plan.step, self.plan.per_call)])
        return self.stepper.step(lambda: next(pieces), lr)

    def _boost(self) -> None:
        """XGBLoRA: merge the booster when its steps are done."""
        if self.method.boosting is None:
            return
        event = self.method.boosting.after_step(self.step, None, self.stepper.forget)
        if event is not None:
            self.metrics.log({**event, "step": self.step})

    def _log(self, lr: float) -> dict[str, str]:
        """One metrics record: the loss window, the current generation batch's rewards, the loss's statistics;
        returns the progress bar's summary."""
        mean, skipped = self.window.drain()
        if skipped and self.cfg.nan_policy == "stop":
            raise UserError(f"GRPO loss is nan or inf at step {self.step}; stopping (try a lower --learning_rate, "
                            f"or --nan_policy skip)")
        current = self.buffer.current
        record = {"step": self.step, "loss": mean, "lr": lr, **current.metrics, **self._loss_statistics(),
                  **{name: sum(v) / len(v) for name, v in self.reward_metrics.items()},
                  "elapsed_s": round(self.earlier_s + time.perf_counter() - self.started, 3)}
        self.reward_metrics = {}
        if current.samples:
            record["samples"] = current.samples
        self.metrics.log(record)
        shown = {"reward": record["reward"], **({"acc": record["accuracy"]} if "accuracy" in record else {}),
                 "len": record["completion_length"], **({"kl": record["kl"]} if "kl" in record else {})}
        if not tqdm_on_terminal():
            log.info("step %d/%d  loss %s  %s", self.step, self.max_steps,
                     "nan" if mean is None else f"{mean:.4f}", _fmt(shown))
        return {k: f"{v:.3g}" for k, v in shown.items()}

    def _loss_statistics(self) -> dict[str, float]:
        """The loss's statistics since the last logging step (clip ratios, KL, entropy), means over the ranks."""
        means = self.loss_fn.statistics.drain()
        values = self.dist.all_mean(torch.tensor(list(means.values()), dtype=torch.float64, device=self.device))
        return dict(zip(means, values.tolist(), strict=True))

    def _save(self) -> Path:
        self.metrics.flush()
        path = self.checkpointer.save(f"step-{self.step}", self.state_dict())
        if self.dist.is_main:
            prune(self.checkpointer.root, self.cfg.save_total_limit)
        return path


def tqdm_on_terminal() -> bool:
    """Whether the progress bar shows (a terminal); else progress goes to the log, one line per logging step."""
    return sys.stderr.isatty()


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())


def run_grpo(cfg: GRPOConfig) -> dict[str, Any]:
    """`xgblora grpo`: train, then write final/ and results.json (see the module docstring). Under torchrun or
    accelerate launch every process trains on its share of each generation batch; the main one owns the folder."""
    dist = setup(cfg)  # before the model loads: it picks this rank's GPU
    out = Path(cfg.output_dir)
    with atomic.output_folder(out, "--output_dir"), run_lock(out) if dist.is_main else contextlib.nullcontext():
        if (out / "results.json").exists() and not cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
            raise UserError(f"{out} already holds a finished run; pass --overwrite_output_dir to redo it, or "
                            f"another --output_dir")
        results = GRPORun(cfg, dist).fit()
        if dist.is_main:
            write_results(cfg, results)
            write_grpo_report(out, results)
    return results
