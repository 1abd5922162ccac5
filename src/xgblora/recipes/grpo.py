"""`xgblora grpo`: online RL with verifiable rewards or a reward model (GRPO, with TRL's GRPOTrainer's options and
defaults; RLOO, TRL's RLOOTrainer, with --advantage_estimator rloo) for full fine-tuning, LoRA and XGBLoRA, under
AdamW or MeZO.

Every generation batch: the next generation_batch / G prompts (seeded epochs, resumable) are sampled G times each
by the shared-prefix sampler (the policy, dropout off), the reward functions (and --reward_model, loaded once before
the policy) score the completions, the rewards become group-normalised advantages (RLOO: leave-one-out ones, the KL
taken off the rewards), and one pass without gradients gives what the loss needs besides: the old
log-probabilities, when the batch serves more than one optimizer step, MeZO (whose two-point estimate needs the
ratio's value) or RLOO's KL, and the reference ones when beta > 0 (the model as it started: a new adapter switched off, a
continued adapter's starting factors, no second model; a frozen copy under full fine-tuning). The batch is
shuffled by groups and cut into optimizer batches; each optimizer step takes the next (AdamW: in micro-batches,
accumulated; MeZO: the whole optimizer batch, two perturbed forwards), and after num_iterations passes a new batch is
sampled. Under --zo_objective reward (evolution strategies) there is no generation batch: each step's batch is its
prompts and a sampling seed, and the loss of a perturbed policy is minus the rewards of the completions it samples
itself (`PolicyReward`). The loop is `xgblora train`'s (`Trainer`, with `Generations` as its source of batches over a
`Rollout`, and `GRPOLoss` as its loss) and so is the run's lifecycle (`lifecycle.run_recipe`), so the schedule,
XGBLoRA's merges, the NaN policy, evaluation, checkpoints, resume and the outputs behave as there.

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
saved with the optimizer state), final/ (as `xgblora train`, with its model card), results.json (held-out pass@1
before and after), grpo.png and report.html (the curves of metrics.jsonl).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from xgblora.config import GRPOConfig
from xgblora.data import formats
from xgblora.distributed import LOCAL, Distributed
from xgblora.errors import UserError
from xgblora.generation.generate import Prompts, read_prompt_rows, read_prompts, sampling_params
from xgblora.generation.grpo_batches import Generations, Plan, PolicyReward
from xgblora.generation.grpo_objective import GRPOLoss, GRPOObjective
from xgblora.generation.rewards import RewardModel, Rewards, load_reward_model
from xgblora.generation.rollout import Rollout
from xgblora.generation.tools import Agent, Toolbox, check_tool_template, response_parser
from xgblora.models import pretrained
from xgblora.optim.zo_estimators import spreads_members
from xgblora.recipes.lifecycle import Prepared, run_recipe
from xgblora.report import GRPO_PANELS
from xgblora.train.loop import Trainer
from xgblora.train.setup import TrainingRun, autocast_dtype, load_policy, loss_model, setup_method

log = logging.getLogger("xgblora")


def run_grpo(cfg: GRPOConfig) -> dict[str, Any]:
    """`xgblora grpo`: train, then write final/ and results.json (see the module docstring). Under torchrun or
    accelerate launch every process trains on its share of each generation batch; the main one owns the folder."""
    return run_recipe(cfg, functools.partial(_recipe, cfg))


def _recipe(cfg: GRPOConfig, dist: Distributed) -> Prepared:
    """The run in the lifecycle's terms: after fit(), the held-out prompts' pass@1 and mean reward."""
    trainer, source = prepare(cfg, dist)
    run = trainer.run

    def results() -> dict[str, Any]:
        after = run.evaluate(run.model, run.monitor)[0] if run.monitor else {}
        estimator = run.cfg.advantage_estimator
        policy_loss = run.cfg.policy_loss if estimator == "grpo" else "rloo"
        return {"advantage_estimator": estimator, "policy_loss": policy_loss, "num_train": len(source.prompts.ids),
                "generation_batches": source.generations, **{f"eval_{k}": v for k, v in after.items()}}

    return Prepared(run.cfg, run.device, trainer, results, data=cfg.train_file, tags=("grpo",),
                    curves=("grpo", GRPO_PANELS))


def warn_sequence_level(cfg: GRPOConfig) -> None:
    """Warn, as TRL does, where sequence-level ratios meet a loss that adds up token terms: that is not GSPO's
    objective, which averages each completion's terms (--policy_loss grpo)."""
    if cfg.importance_sampling_level == "sequence" and cfg.policy_loss != "grpo":
        log.warning("--importance_sampling_level sequence with --policy_loss %s: this loss adds up per-token terms, so "
                    "each completion weighs by its length rather than once; GSPO's objective is --policy_loss grpo",
                    cfg.policy_loss)


def read_grpo_prompts(cfg: GRPOConfig, source: str, tokenizer: Any, rewards: Rewards,
                      toolbox: Toolbox | None = None) -> Prompts:
    """The prompts of a file (describing the tools); with a correctness reward, each needs a reference answer."""
    prompts = read_prompts(source, tokenizer, columns=cfg.columns, raw=cfg.raw_prompts, max_length=cfg.max_length,
                           tools=toolbox.schemas if toolbox else None)
    if rewards.accuracy_index is not None:
        for example, row in zip(prompts.examples, prompts.rows, strict=True):
            if not example.answers and "reference" not in row:
                raise UserError(f"{example.source}: no reference answer for --reward_funcs "
                                f"{rewards.names[rewards.accuracy_index]} (a completion, response, or final "
                                f"assistant turn; --columns completion=answer maps yours)")
    return prompts


def check_tool_prompts(cfg: GRPOConfig, toolbox: Toolbox | None) -> None:
    """Tools are described through the chat template: a string prompt sent as it is (--raw_prompts) cannot
    describe them (checked before the model loads)."""
    if toolbox is None or not cfg.raw_prompts:
        return
    for source in filter(None, (cfg.train_file, cfg.eval_file)):
        raw = next((ex for ex in read_prompt_rows(source, cfg.columns)[1] if not ex.messages), None)
        if raw is not None:
            raise UserError(f"{raw.source}: a string prompt is sent as it is (--raw_prompts true), so the chat "
                            f"template cannot describe the tools to the model; give conversational prompts, or "
                            f"pass --raw_prompts false")


def tool_agent(cfg: GRPOConfig, toolbox: Toolbox | None, model: torch.nn.Module, tokenizer: Any) -> Agent | None:
    """The agent that answers the policy's tool calls: the chat template checked to render a tool exchange and
    given a response template that reads the calls."""
    if toolbox is None:
        return None
    check_tool_template(tokenizer)
    response_parser(tokenizer)
    return Agent(toolbox, tokenizer, cfg.max_new_tokens, cfg.max_tool_calling_iterations, cfg.tool_timeout,
                 getattr(model.config, "max_position_embeddings", None))


class HeldOut:
    """The held-out evaluation (the Trainer's evaluator): pass@1 of greedy completions of the held-out prompts (the
    first correctness reward) and their mean reward; each process scores its share (none to score without
    --eval_file)."""

    def __init__(self, rollout: Rollout, prompts: Prompts | None, source: Generations, dist: Distributed):
        self.rollout, self.prompts, self.source, self.dist = rollout, prompts, source, dist

    def evaluate(self, model: torch.nn.Module, heldout: Sequence[int],  # noqa: ARG002 (the policy samples)
                 demos: Sequence = ()) -> tuple[dict[str, float], list]:  # noqa: ARG002
        """The metrics (the first decides the best step) and no predictions."""
        rewards = self.rollout.rewards
        indices = list(heldout)[self.dist.rank::self.dist.world_size]
        per_function = self.rollout.gathered(self._greedy_scores(indices) if indices
                                             else torch.empty(0, len(rewards.names)))[0]  # more ranks than prompts
        reward = {"reward": float(rewards.total(per_function).nanmean())}
        if rewards.accuracy_index is None:
            return reward, []
        return {"pass@1": float(per_function[:, rewards.accuracy_index].nanmean()), **reward}, []

    def _greedy_scores(self, indices: list[int]) -> torch.Tensor:
        """Rewards [prompts, functions] of a greedy completion of each held-out prompt in indices."""
        params = dataclasses.replace(sampling_params(self.rollout.cfg), num_samples=1, temperature=0.0)
        done = self.rollout.completions(self.prompts, indices, params)
        return self.rollout.score(self.prompts, indices, done, self.source.trainer_state())


def reward_model_of(cfg: GRPOConfig, dist: Distributed) -> RewardModel | None:
    """--reward_model, loaded once on the policy's device and in its dtype, before the policy (a bad one stops the
    run first); None without one."""
    if not cfg.reward_model:
        return None
    return load_reward_model(cfg.reward_model, dtype=cfg.dtype_name,
                             device=str(pretrained.choose_device(dist.device or cfg.device)),
                             attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code,
                             batch_size=cfg.per_device_eval_batch_size)


def prepare(cfg: GRPOConfig, dist: Distributed = LOCAL) -> tuple[Trainer, Generations]:
    """The run's Trainer, on GRPO's loss and its generation batches (the reward functions and the batch plan
    checked before the model loads)."""
    warn_sequence_level(cfg)
    # spread members: every process samples the step's whole batch, as one process would
    plan = Plan.of(cfg, 1 if spreads_members(cfg, cfg.trainer) else dist.world_size)
    toolbox = Toolbox.of(cfg)
    check_tool_prompts(cfg, toolbox)
    rewards = Rewards(cfg.reward_funcs, cfg.reward_weights, cfg.answer_tolerance, reward_model_of(cfg, dist),
                      toolbox.reward_function() if toolbox else None)
    template = formats.read_chat_template(cfg.chat_template) if cfg.chat_template else None
    cfg, model, tokenizer = load_policy(cfg, dist, template)
    agent = tool_agent(cfg, toolbox, model, tokenizer)
    # full fine-tuning has no adapter to switch off: its reference is a frozen copy (only when beta needs it)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if cfg.method == "ft" and cfg.beta else None
    method = setup_method(model, cfg)
    device = next(model.parameters()).device
    autocast = autocast_dtype(cfg, device)
    rollout = Rollout(cfg, model, tokenizer, method, rewards, plan.group, dist, autocast, reference, agent)
    source = Generations(cfg, plan, rollout, read_grpo_prompts(cfg, cfg.train_file, tokenizer, rewards, toolbox), dist)
    heldout = read_grpo_prompts(cfg, cfg.eval_file, tokenizer, rewards, toolbox) if cfg.eval_file else None
    run = TrainingRun(cfg, model, tokenizer, device, HeldOut(rollout, heldout, source, dist).evaluate,
                      monitor=list(range(len(heldout.ids))) if heldout else [])
    if cfg.zo_objective == "reward":
        return Trainer(run, method, source, PolicyReward(source), dist), source
    policy, fused = loss_model(run, dist)  # the sampler and the log-probability passes run the eager model
    loss = GRPOLoss(policy, GRPOObjective.of(cfg), cfg.temperature, autocast, fused=fused)
    return Trainer(run, method, source, loss, dist), source
