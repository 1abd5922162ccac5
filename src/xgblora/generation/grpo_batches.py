"""GRPO's training batches: `Generations`, the Trainer's source of batches (`train/loop.py`'s BatchSource) over a
`Rollout`. Each cycle of optimizer steps draws the next generation batch's prompts (seeded epochs, resumable), has
the rollout sample, score and prepare them, shuffles the batch by groups and serves it in optimizer batches, each
cut into the stepper's calls. Under --zo_objective reward there is no generation batch: each step's batch is its
prompts and a sampling seed (`PromptBatch`), and its loss (`PolicyReward`) is minus the rewards of the completions
that the perturbed policy samples itself."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from xgblora.adapters.lora import MemberRows
from xgblora.config import GRPOConfig
from xgblora.data.collation import TokenSeq, collate
from xgblora.data.order import BatchStream
from xgblora.distributed import Distributed
from xgblora.errors import UserError
from xgblora.generation.generate import Prompts, sampling_params
from xgblora.generation.grpo_objective import CompletionBatch, GRPOObjective, row_weights
from xgblora.generation.rollout import Completions, Rollout
from xgblora.models.sampler import stream_seed
from xgblora.optim.zo_estimators import spreads_members

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
    the population samples them with (common random numbers: two members differ by their weights, not their luck);
    `repeated` makes it the batch of several members sampled together."""

    indices: list[int]
    seed: int
    prompt_tokens: int
    copies: int = 1
    rows: MemberRows | None = None  # batched members: told the member of every row the sampler runs

    def repeated(self, copies: int, rows: MemberRows) -> PromptBatch:
        """The prompts once for each of `copies` members sampled in one batch (member k: the k-th copy)."""
        return dataclasses.replace(self, copies=copies, rows=rows)

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
    as Qiu et al. fine-tune LLMs ("Evolution Strategies at Scale", arXiv 2509.24372): perturb, sample, score. The
    members' reward statistics are the batch source's (`Generations.metrics`)."""

    def __init__(self, source: Generations):
        self.source, self.model = source, source.rollout.model

    def __call__(self, batch: PromptBatch) -> torch.Tensor:
        """[copies]: each member's minus mean reward of its completions that were scored (a reward function's None
        leaves one out); NaN when none was."""
        return -self.source.policy_rewards(batch).nanmean(1)

    def metrics(self) -> dict[str, float]:
        return {}


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


class Generations:
    """GRPO's training batches over the rollout of `prompts` (see the module docstring); its metrics() add the
    current generation batch's reward statistics (under --zo_objective reward: the population's), the reward
    functions' log_metric means and, with --log_completions, a few completions."""

    def __init__(self, cfg: GRPOConfig, plan: Plan, rollout: Rollout, prompts: Prompts, dist: Distributed):
        # the loss and the old and reference log-probabilities run in the mode this sets (TRL's disable_dropout,
        # off by default as there); sampling always runs without dropout
        self.dropout = not cfg.disable_dropout
        self.cfg, self.plan, self.rollout, self.prompts, self.dist = cfg, plan, rollout, prompts, dist
        self.policy_loss = GRPOObjective.of(cfg).policy_loss  # how token losses add up (RLOO: each completion once)
        # --zo_es_spread members: every process samples all of a step's prompts, with one seed, for its members
        self.members_spread = spreads_members(cfg, cfg.trainer)
        self.max_steps = cfg.max_steps if cfg.max_steps > 0 else self.plan.cycle * max(
            1, round(cfg.num_train_epochs * len(prompts.ids) / self.plan.prompts))
        self.stream = BatchStream([len(ids) for ids in prompts.ids], 1, cfg.seed, group_by_length=False)
        self.buffer = GenerationBuffer(dist, rollout.device)
        self.components = {"generation": self.buffer}
        self.step = 0
        self.population: list[dict[str, float]] = []  # --zo_objective reward: each member's statistics since the log

    @property
    def generations(self) -> int:
        """Generation batches sampled so far."""
        return self.buffer.generations

    def batches(self, step: int) -> Callable[[], CompletionBatch | PromptBatch]:
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
        """What a logging step adds (see the class docstring)."""
        functions = self.rollout.reward_function_metrics()
        if self.cfg.zo_objective == "reward":
            return {**self._population_metrics(), **functions}
        current = self.buffer.current
        record = {**current.metrics, **functions}
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

    def trainer_state(self) -> transformers.TrainerState:
        """What TRL hands reward functions as trainer_state (transformers' TrainerState): the step, epoch, budget."""
        epoch = self.stream.epoch + self.stream.cursor / max(1, len(self.prompts.ids))
        return transformers.TrainerState(epoch=epoch, global_step=self.step, max_steps=self.max_steps,
                                         logging_steps=self.cfg.logging_steps, eval_steps=self.cfg.eval_steps,
                                         save_steps=self.cfg.save_steps,
                                         train_batch_size=self.cfg.per_device_train_batch_size)

    def generate(self) -> Generation:
        """Sample, score and prepare this process's share of the next generation batch (see the module
        docstring)."""
        cfg, plan, rollout = self.cfg, self.plan, self.rollout
        indices = self._next_prompts()
        params = dataclasses.replace(sampling_params(cfg), seed=self._sampling_seed(self.buffer.generations))
        done = rollout.completions(self.prompts, indices, params)
        kl_in_reward = cfg.advantage_estimator == "rloo" and cfg.beta > 0  # RLOO's KL comes from the old policy
        batch = rollout.with_logprobs(self._collated(indices, done),
                                      old=cfg.trainer == "zo" or plan.cycle > 1 or kl_in_reward)
        rewards, advantage, metrics = rollout.rewarded(self.prompts, indices, done, self.trainer_state(),
                                                      self.buffer.generations + 1,
                                                      kl=rollout.kl_sums(batch) if kl_in_reward else None)
        batch = dataclasses.replace(batch, advantages=advantage.to(rollout.device))
        # groups shuffled whole (TRL shuffles rows; the loss is the same sum): a prompt's completions then share
        # its forward in the loss (completion_logprobs)
        groups = torch.randperm(len(indices), generator=torch.Generator().manual_seed(params.seed))
        batch = batch.rows((groups[:, None] * plan.group + torch.arange(plan.group)).flatten())
        # dapo and cispo divide by the generation batch's tokens on all ranks
        tokens_everywhere = float(rollout.gathered(batch.target_mask.sum(1, keepdim=True))[0].sum())
        weights = row_weights(batch.target_mask.cpu(), self.policy_loss, cfg.max_new_tokens, plan.step,
                              tokens_everywhere, plan.steps_per_generation * self.dist.world_size,
                              cfg.per_device_train_batch_size)
        self.buffer.generations += 1
        return Generation(dataclasses.replace(batch, nll_weight=weights.to(rollout.device)), metrics,
                          self._logged(indices, done, rewards) if cfg.log_completions else [])

    def _collated(self, indices: list[int], done: Completions) -> CompletionBatch:
        """The completions as rows after their prompts, their advantages still 0 (--mask_truncated_completions: a
        cut one carries no loss; tool turns carry none). A rollout whose environment changed its prompt has a prompt
        of its own (an id past the file's prompts)."""
        row_prompts = [i for i in indices for _ in range(self.plan.group)]
        prompts = [self.prompts.ids[i] for i in row_prompts]
        own: list[tuple[bool, ...] | None] = [None] * len(prompts)
        if done.rollouts is not None:
            own = [tuple(r.own) for r in done.rollouts]
            row_prompts = [i if r.prompt == prompts[j] else len(self.prompts.ids) + j
                           for j, (i, r) in enumerate(zip(row_prompts, done.rollouts, strict=True))]
            prompts = [r.prompt for r in done.rollouts]
        seqs = [TokenSeq(tuple(p) + tuple(c), len(c), i, 0, mask)
                for i, p, c, mask in zip(row_prompts, prompts, done.ids, own, strict=True)]
        tokens = collate(seqs, self.rollout.tokenizer.pad_token_id)
        mask = tokens.target_mask & ~done.truncated[:, None] if self.cfg.mask_truncated_completions \
            else tokens.target_mask
        return CompletionBatch(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                               position_ids=tokens.position_ids, target_mask=mask,
                               prompt_id=torch.tensor(row_prompts),
                               prompt_length=torch.tensor([len(p) for p in prompts]),
                               advantages=torch.zeros(len(row_prompts)))

    def _logged(self, indices: list[int], done: Completions, rewards: torch.Tensor) -> list[dict[str, Any]]:
        """A few completions with their prompt, reward and the reward functions' log_extra columns."""
        extra = self.rollout.extra_columns
        return [{"prompt": self.prompts.rows[indices[j // self.plan.group]], "completion": done.texts[j],
                 "reward": float(rewards[j]), **{k: v[j] for k, v in extra.items() if j < len(v)}}
                for j in range(min(SAMPLES_LOGGED, len(done.texts)))]

    def policy_rewards(self, batch: PromptBatch) -> torch.Tensor:
        """[copies, completions]: the total rewards of G completions of each of batch's prompts for each member it
        carries, sampled now (see PolicyReward), each prompt from a seed of its own drawn from batch's, the same for
        every member (with tools, each turn from batch's); each member's statistics join the population's for the
        next logging step."""
        params = dataclasses.replace(sampling_params(self.cfg), seed=batch.seed)
        n, copies = len(batch.indices), batch.copies
        seeds = None if self.rollout.agent is not None else [stream_seed(batch.seed, j) for j in range(n)] * copies
        done = self.rollout.completions(self.prompts, batch.indices * copies, params, seeds,
                                        None if batch.rows is None else functools.partial(_follow, batch.rows, n))
        width, rewards = len(done.texts) // copies, []
        for k in range(copies):
            # spread members: the member's completions are all on this process, and the others score other members
            member, _, metrics = self.rollout.rewarded(self.prompts, batch.indices, done.part(k * width, width),
                                                       self.trainer_state(), self.buffer.generations + 1,
                                                       gather=not self.members_spread)
            self.population.append(metrics)
            rewards.append(member)
        return torch.stack(rewards).to(self.rollout.device)

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


def _follow(rows: MemberRows, prompts: int, positions: torch.Tensor) -> None:
    """The sampler's rows -> their members: position p of a batch of members' prompts is member p // prompts's."""
    rows.index = positions // prompts
