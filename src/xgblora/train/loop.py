"""The training loop and the run's state: one `Trainer` owns the stepper, the schedule, the batch stream, the
logged-loss window, boosting, evaluation and checkpoints; `Trainer.fit()` reads top to bottom.

Resuming is exact: a checkpoint holds the loop state (step, epoch, cursor, best, the logging window in flight),
the RNG states, the stepper's state and the booster history, and the learning rate is a function of the step.
It also holds the training time up to the save and the number of resumes, so that the run's statistics cover
every part of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from xgblora import distributed, perf
from xgblora.checkpoint import Checkpointer, prune, step_checkpoints
from xgblora.config import TaskTrainingOptions, TrainerConfig
from xgblora.data.batches import Batch
from xgblora.data.order import BatchStream
from xgblora.distributed import Distributed
from xgblora.errors import UserError
from xgblora.logs import MetricsLog, ProgressLine
from xgblora.models.checkpointing import enable_checkpointing
from xgblora.models.kernels import use_liger_kernels
from xgblora.optim.fo import AdamWStepper
from xgblora.optim.schedule import Schedule
from xgblora.optim.zo_estimators import build_estimator, stepper_type
from xgblora.options import ZOHeadOptions
from xgblora.trackers import open_trackers, parse_report_to
from xgblora.train.head import HeadTrainer
from xgblora.train.objective import TrainingSet
from xgblora.train.results import adapter_task_type, save_final, write_adapter
from xgblora.train.setup import Method, TrainingRun

log = logging.getLogger("xgblora")


class Stepper(Protocol):
    """One optimizer step per call: AdamW (optim.fo) or MeZO (optim.zo)."""

    def step(self, next_batch: Callable[[], Batch], lr: float) -> torch.Tensor: ...

    def forget(self, params: Any) -> None: ...

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Loss(Protocol):
    """What the steppers call: per-example losses of a batch, from `model` (which a stepper may wrap, e.g. FSDP);
    `metrics()`: this process's statistics of the losses since the last call, which the Trainer averages over the
    processes and logs (a loss without statistics returns {})."""

    model: torch.nn.Module

    def __call__(self, batch: Batch) -> torch.Tensor: ...

    def metrics(self) -> dict[str, float]: ...


class BatchSource(Protocol):
    """Where a run's training batches come from: `batches(step)` is what the stepper calls for each micro-batch
    (AdamW) or batch (ZO) of that step. Its `stream` (epoch, cursor) is saved with the loop state, its `components`
    beside the stepper in each checkpoint; `metrics()` adds to each logged record."""

    stream: BatchStream
    max_steps: int
    dropout: bool  # whether training forwards run in train mode, with the model's dropout (AdamW only: MeZO's never do)
    components: dict[str, Any]

    def batches(self, step: int) -> Callable[[], Batch]: ...

    def metrics(self) -> dict[str, Any]: ...


class ExampleBatches:
    """A training set's batches in BatchStream's order (seeded epochs, length-grouped with `group_by_length`): this
    process's share of each global batch; --max_steps, else --num_train_epochs over the set."""

    def __init__(self, train_set: TrainingSet, cfg: TrainerConfig, dist: Distributed, group_by_length: bool,
                 dropout: bool = True):
        self.dropout = dropout
        self.train_set = dist.shard(train_set)  # batch(global batch) collates this rank's shard of it
        global_batch = cfg.per_device_train_batch_size * dist.world_size
        self.stream = BatchStream(self.train_set.lengths, global_batch, cfg.seed, group_by_length)
        self.max_steps = total_steps(cfg, len(self.train_set.lengths), global_batch)
        self.components: dict[str, Any] = {}
        self._order: Iterator[list[int]] | None = None

    def batches(self, step: int) -> Callable[[], Batch]:  # noqa: ARG002 (every call draws the stream's next batch)
        return self._next

    def _next(self) -> Batch:
        if self._order is None:  # first drawn after a resume has set the stream's cursor
            self._order = iter(self.stream)
        return self.train_set.batch(next(self._order))

    def metrics(self) -> dict[str, Any]:
        return {}


class LossWindow:
    """The training losses since the last log, summed on the device: no host sync per step, one when drained."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), device=device)
        self.finite = torch.zeros((), device=device)
        self.steps = 0

    def add(self, loss: torch.Tensor | None) -> None:
        """Count one step's loss (a non-finite one counts as a skipped step; None, a step that measured no loss and
        said so, neither)."""
        if loss is None:
            return
        ok = torch.isfinite(loss.detach())
        self.total += torch.where(ok, loss.detach(), 0.0)
        self.finite += ok
        self.steps += 1

    def drain(self) -> tuple[float | None, int]:
        """(mean of the finite losses or None, number of non-finite ones); the window starts over."""
        total, finite = torch.stack([self.total, self.finite]).tolist()  # the one host sync
        skipped = self.steps - int(finite)
        self.total.zero_()
        self.finite.zero_()
        self.steps = 0
        return (total / finite if finite else None), skipped

    def state_dict(self) -> list[float]:
        """[sum of finite losses, their count, steps] of the window in flight."""
        return [float(self.total), float(self.finite), self.steps]

    def load_state_dict(self, values: list[float]) -> None:
        """Restore what state_dict() returned."""
        self.total.fill_(values[0])
        self.finite.fill_(values[1])
        self.steps = int(values[2])


@dataclass
class LoopState:
    """Where the run stands: steps done, the data cursor, the best dev score, the logging window, and the
    training time and resumes of all its parts so far."""

    stream: BatchStream
    window: LossWindow
    step: int = 0
    best: dict[str, Any] | None = None
    before: dict[str, Any] = field(default_factory=dict)  # --eval_on_start: the evaluation before the first step
    last_loss: float | None = None
    resumes: int = 0
    earlier_parts_s: float = 0.0  # training time of the parts before this one, up to the checkpoint resumed
    part_started: float = field(default_factory=time.perf_counter)

    def runtime_s(self) -> float:
        """Training time of the whole run so far: the earlier parts' and this part's."""
        return self.earlier_parts_s + time.perf_counter() - self.part_started

    def state_dict(self) -> dict[str, Any]:
        """The loop state as JSON values."""
        return {"step": self.step, "epoch": self.stream.epoch, "cursor": self.stream.cursor, "best": self.best,
                "before": self.before, "window": self.window.state_dict(), "runtime_s": self.runtime_s(),
                "resumes": self.resumes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""
        self.step, self.best, self.before = state["step"], state["best"], state["before"]
        self.stream.epoch, self.stream.cursor = state["epoch"], state["cursor"]
        self.window.load_state_dict(state["window"])
        self.earlier_parts_s, self.resumes = state["runtime_s"], state["resumes"]


@dataclass
class Hooks:
    """Callbacks into the loop: on_step_end(state) runs after each step's update and logging."""

    on_step_end: list[Callable[[LoopState], None]] = field(default_factory=list)


class StopRequested(KeyboardInterrupt):
    """SIGINT/SIGTERM arrived: the loop saved a checkpoint and stopped."""


@contextlib.contextmanager
def graceful_stop() -> Iterator[dict[str, bool]]:
    """Turn SIGINT/SIGTERM into a flag the loop checks after each step (the step in flight finishes)."""
    flag = {"stop": False}

    def handler(signum, frame):  # noqa: ARG001
        if flag["stop"]:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        flag["stop"] = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def build_stepper(cfg: TrainerConfig, method: Method, loss_fn: Loss, dist: Distributed, device: torch.device,
                  head: ZOHeadOptions | None = None, grouped: bool = False) -> Stepper:
    """AdamW (--trainer regular) or a zeroth-order estimator (--trainer zo, --zo_estimator) over the method's
    trainable parameters; `head`: how a new head (a classifier's, a reranker's, a reward model's) trains under
    --trainer zo, for the commands that train one; `grouped`: batches score candidates side by side
    (--train_as_classification)."""
    boosting = method.boosting
    if cfg.trainer == "regular":
        if cfg.activation_offloading and device.type != "cuda":
            raise UserError(f"--activation_offloading moves saved activations from a CUDA device to host memory; on "
                            f"{device.type} they are in host memory already (try --gradient_checkpointing)")
        penalty = (lambda: boosting.norm_penalty(cfg.norm_penalty)) \
            if boosting is not None and cfg.norm_penalty > 0 else None
        return AdamWStepper(method.named_params, loss_fn, weight_decay=cfg.weight_decay,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                            fused=None if cfg.fused_adamw else False, max_grad_norm=cfg.max_grad_norm,
                            accumulation=cfg.gradient_accumulation_steps, micro_batch=cfg.per_device_train_batch_size,
                            nan_policy=cfg.nan_policy, penalty=penalty, dist=dist, offload=cfg.activation_offloading)
    zo_params = method.zo_params(head.head_trainer if head is not None else "zo")  # without a head: all the same
    # the doubled batch, like ES's batched members, carries adapter perturbations only: not a full model, a
    # zo-trained head, or grouped rows
    adapters_only = bool(method.modules) and len(zo_params) == len(method.trainable) and not grouped
    dual = adapters_only and (cfg.zo_dual is not False or cfg.zo_member_batch > 1)
    # the norm penalty l(|A|^2 + |B|^2) has the exact gradient 2l*theta, added to the estimate as AdamW adds it
    penalty = 2 * cfg.norm_penalty if boosting is not None else 0.0
    estimator = build_estimator(cfg, zo_params, cfg.learning_rate, seed=cfg.seed, weight_decay=cfg.weight_decay,
                                betas=(cfg.adam_beta1, cfg.adam_beta2), adam_eps=cfg.adam_epsilon, penalty=penalty,
                                dual_modules=method.modules if dual else None, dist=dist)
    # a new head exists on classifier and reranker runs only, whose loss is a TrainingLoss
    head_trainer = HeadTrainer(loss_fn.model, method.head, head.head_learning_rate, loss_fn.head_loss,
                               reduce=dist.reduce_step) \
        if head is not None and head.head_trainer == "first-order" and method.head else None
    return stepper_type(estimator)(estimator, loss_fn, nan_policy=cfg.nan_policy, device=device, head=head_trainer)


# What the progress bar and line show of a logged record, when it holds them: the loss, and what GRPO, DPO and
# reward-model users watch.
PROGRESS_NAMES = {"loss": "loss", "reward": "reward", "accuracy": "acc", "completion_length": "len", "kl": "kl",
                  "rewards/accuracies": "pref_acc", "rewards/margins": "margin", "margin": "margin"}


def total_steps(cfg: TrainerConfig, n_examples: int, global_batch: int) -> int:
    """--max_steps, else the optimizer steps of --num_train_epochs epochs."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return math.ceil(cfg.num_train_epochs * math.ceil(n_examples / global_batch) / cfg.gradient_accumulation_steps)


class Trainer:
    """The state of one training run and the loop over it: `source` hands each step its batches, `loss` turns a
    batch into per-example losses for the stepper (and its statistics into each logged record). It reads the
    options every trainer has (TrainerConfig); `task` adds those of training on a task's examples (train's:
    candidates scored side by side, logged dev generations, an embedding model's or a reranker's final/), `head`
    how a new head trains under --trainer zo (train's and reward's)."""

    def __init__(self, run: TrainingRun, method: Method, source: BatchSource, loss: Loss, dist: Distributed,
                 hooks: Hooks | None = None, task: TaskTrainingOptions | None = None,
                 head: ZOHeadOptions | None = None):
        cfg = self.cfg = run.cfg
        self.task = task
        self.run, self.method, self.source, self.dist = run, method, source, dist
        self.hooks = hooks or Hooks()
        self.max_steps = source.max_steps
        boosting = method.boosting
        if boosting is not None:
            chosen = cfg.xgblora_steps_per_iteration is not None or cfg.xgblora_num_boosters is not None
            boosting.plan(cfg.booster_steps(self.max_steps), self.max_steps, chosen)
        # --xgblora_restart_schedule: the schedule spans one booster and starts over at every merge
        span = boosting.steps_per_iteration if boosting is not None and cfg.xgblora_restart_schedule else self.max_steps
        self.schedule = Schedule(cfg.lr_scheduler_type, cfg.learning_rate, span,
                                 cfg.warmup_steps or int(cfg.warmup_ratio * span))
        if cfg.use_liger_kernel:
            use_liger_kernels(run.model, run.device)
        if cfg.gradient_checkpointing and cfg.trainer == "regular":
            enable_checkpointing(run.model)
        self.loss_fn = loss
        grouped = task is not None and task.train_as_classification
        self.stepper = build_stepper(cfg, method, self.loss_fn, dist, run.device, head, grouped)
        self.state = LoopState(source.stream, LossWindow(run.device))
        self.checkpointer = self._checkpointer()
        if cfg.resume_from_checkpoint:
            path, loop_state = self.checkpointer.restore(cfg.resume_from_checkpoint)
            self.state.load_state_dict(loop_state)
            self.state.resumes += 1
            log.info("resumed from %s at step %d", path, self.state.step)
        self.loss_fn.model = self.stepper.prepare(self.loss_fn.model)  # FSDP wraps after loading
        self.progress_line = ProgressLine(self.max_steps, self.state.step, enabled=None if dist.is_main else False)

    def next_batches(self) -> Callable[[], Batch]:
        """The current step's batches, on the device, counted by the progress line."""
        draw = self.source.batches(self.state.step)

        def next_batch() -> Batch:
            batch = draw()
            self.progress_line.count(batch)
            return batch.to(self.run.device)

        return next_batch

    def train_step(self) -> tuple[torch.Tensor, float]:
        """One optimizer step: its loss and learning rate."""
        lr = self.schedule(self._schedule_step())
        loss = self.stepper.step(self.next_batches(), lr)
        self.state.step += 1
        return loss, lr

    def _checkpointer(self) -> Checkpointer:
        boosting = self.method.boosting
        with_bases = boosting is not None  # merged boosters live in the base weights

        def tensors() -> dict[str, torch.Tensor]:
            return self.dist.full_state(self.method.trainable_state(with_bases), self.loss_fn.model)

        learnt = self.method.contrastive is not None and self.method.contrastive.log_scale is not None
        return Checkpointer(Path(self.cfg.output_dir) / "checkpoints", model=self.run.model, tensors=tensors,
                            components={"stepper": self.stepper, **self.source.components,
                                        **({"temperature": self.method.contrastive} if learnt else {})},
                            model_components={"boosting": boosting} if boosting is not None else {},
                            save_only_model=self.cfg.save_only_model, is_main=self.dist.is_main,
                            write_adapter=functools.partial(
                                write_adapter, self.cfg, self.method,
                                task_type=adapter_task_type(self.task, self.run.model))
                            if self.method.modules else None)

    def fit(self) -> dict[str, Any]:
        """Train to max_steps (or a stop signal); return the run's statistics."""
        cfg, state = self.cfg, self.state
        state.part_started = time.perf_counter()  # set-up and resuming are not training time
        # MeZO's forwards run in eval mode: no dropout in L+ vs L-
        self.run.model.train(cfg.trainer == "regular" and self.source.dropout)
        with graceful_stop() as stop, self._metrics() as self.metrics, self._progress() as self.progress:
            if state.step == 0:
                if cfg.eval_on_start:
                    state.before = self._evaluate()
                self._start_booster()
            while state.step < self.max_steps:
                loss, lr = self.train_step()
                state.window.add(loss)
                self._boost(loss)
                if state.step % cfg.logging_steps == 0 or state.step == self.max_steps:
                    self._log(lr)
                self.progress.update(1)
                for hook in self.hooks.on_step_end:
                    hook(state)
                if cfg.evaluation_strategy == "steps" and state.step % cfg.eval_steps == 0:
                    self._evaluate()
                if cfg.save_strategy == "steps" and state.step % cfg.save_steps == 0 and state.step < self.max_steps:
                    self._save_step()
                if self.dist.end_step(stop["stop"]):  # all ranks stop at the same step
                    self._stop()
        return self._finish()

    def _schedule_step(self) -> int:
        """Steps into the schedule: the run's, or with --xgblora_restart_schedule the current booster's."""
        boosting = self.method.boosting
        if boosting is None or not self.cfg.xgblora_restart_schedule:
            return self.state.step
        return min(self.state.step - boosting.booster_start, boosting.steps_per_iteration)

    def _metrics(self) -> MetricsLog | distributed.SilentLog:
        cfg, out, step = self.cfg, Path(self.cfg.output_dir), self.state.step
        if not self.dist.is_main:
            return distributed.SilentLog()
        resume_step = step if step > 0 else None
        trackers = open_trackers(parse_report_to(cfg.report_to), out, out.name, dataclasses.asdict(cfg), resume_step)
        return MetricsLog(out / "metrics.jsonl", trackers=trackers, resume=step > 0, resume_step=resume_step)

    def _progress(self) -> tqdm:
        return tqdm(total=self.max_steps, initial=self.state.step, desc=f"{self.cfg.method}/{self.cfg.trainer}",
                    dynamic_ncols=True, disable=None if self.dist.is_main else True)

    def _boost(self, loss: torch.Tensor) -> None:
        """XGBLoRA: merge the booster when due (the adaptive merge reads the loss: a host sync it alone pays)."""
        if self.method.boosting is None:
            return
        observed = float(loss) if self.cfg.xgblora_adaptive else None
        event = self.method.boosting.after_step(self.state.step, observed, self.stepper.forget)
        if event is not None:
            if self.state.step < self.max_steps:  # a booster merged at the last step has no successor to start
                self._start_booster()
            self.metrics.log({**event, "step": self.state.step})

    def _start_booster(self) -> None:
        """Where Config.booster_init is gradient(-orthogonal): the new booster's A from the gradient of the next
        --xgblora_init_batches training batches (drawn from the run's stream, so a resumed run draws the same ones)."""
        boosting = self.method.boosting
        if boosting is None or self.cfg.booster_init == "random":
            return

        def backward(inputs: list[torch.nn.Parameter]) -> None:
            for _ in range(self.cfg.xgblora_init_batches):
                self.loss_fn(self.next_batches()()).mean().backward(inputs=inputs)

        boosting.init_from_gradients(backward, self.dist.all_mean, self.cfg.booster_init == "gradient-orthogonal")

    def _log(self, lr: float) -> None:
        """Drain the loss window into metrics.jsonl; a non-finite loss stops the run under --nan_policy stop."""
        step, window_start = self.state.step, self.state.step - self.state.window.steps
        mean, skipped = self.state.window.drain()
        if skipped and self.cfg.nan_policy == "stop":
            good = [p for p in step_checkpoints(self.checkpointer.root) if int(p.name[len("step-"):]) <= window_start]
            saved = f"the last checkpoint before it is {good[-1]}" if good else "no checkpoint was saved before it"
            steps = f"step {step}" if window_start + 1 == step else f"steps {window_start + 1}-{step}"
            raise UserError(f"training loss is nan or inf at {steps}; stopping: "
                            f"{saved} (a learning rate too high is the usual cause: try a lower --learning_rate, or "
                            f"--nan_policy skip)")
        self.state.last_loss = mean
        record = {"step": step, "loss": mean, "lr": lr, **self._loss_metrics(), **self.source.metrics(),
                  **({"skipped": skipped} if skipped else {}), "elapsed_s": round(self.state.runtime_s(), 3)}
        self.metrics.log(record)
        shown = {PROGRESS_NAMES[k]: record[k] for k in PROGRESS_NAMES if record.get(k) is not None}
        self.progress.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        self.progress_line.report(step, mean, lr, {k: v for k, v in shown.items() if k != "loss"})

    def _loss_metrics(self) -> dict[str, float]:
        """The loss's statistics since the last logging step, means over the processes."""
        own = self.loss_fn.metrics()
        if not own:
            return {}
        means = self.dist.all_mean(torch.tensor(list(own.values()), dtype=torch.float64, device=self.run.device))
        return dict(zip(own, means.tolist(), strict=True))

    def _evaluate(self) -> dict[str, Any]:
        """Score the dev split (else the user's --eval_file); keep the best step (and its checkpoint with
        --load_best_model_at_end); return the logged metrics (none without a split to score).

        The first metric decides: the highest accuracy or F1, the lowest loss (instruction data)."""
        state = self.state
        if not self.run.monitor:
            return {}
        dev, predictions = self.run.evaluate(self.run.model, self.run.monitor)
        shown = self.task.log_samples if self.task is not None else 0
        samples = {"samples": predictions[:shown]} if shown and predictions else {}
        logged = {f"eval_{k}": v for k, v in dev.items()}
        self.metrics.log({"step": state.step, **logged, **samples})
        name, value = next(iter(dev.items()))
        score = -value if name in ("loss", "perplexity") else value
        if state.best is None or score > state.best["score"]:
            state.best = {"value": value, "score": score, "step": state.step}
            if self.cfg.load_best_model_at_end:
                self._save("best")
        return logged

    def _save(self, name: str) -> Path:
        self.metrics.flush()
        return self.checkpointer.save(name, self.state.state_dict())

    def _save_step(self) -> Path:
        """Save step-N, then prune the step checkpoints to --save_total_limit (periodic and stop saves alike)."""
        path = self._save(f"step-{self.state.step}")
        if self.dist.is_main:
            prune(self.checkpointer.root, self.cfg.save_total_limit)
        return path

    def _stop(self) -> None:
        path = self._save_step()
        raise StopRequested(f"stopped at step {self.state.step}; checkpoint saved to {path}; resume with "
                            f"--resume_from_checkpoint latest")

    def _finish(self) -> dict[str, Any]:
        """Reload the best checkpoint if asked, write final/, and return the run's statistics (time and speed over
        every part of the run: a step redone after a kill counts once, and so does its time)."""
        cfg, state, method = self.cfg, self.state, self.method
        runtime = state.runtime_s()
        self.dist.wait_for_main()  # its checkpoints are written before any rank reads "best"
        best_dir = self.checkpointer.root / "best"
        if cfg.load_best_model_at_end and state.best is not None and best_dir.is_dir():
            self.checkpointer.load_weights(best_dir)  # the boosters merged up to the best step, not after it
            log.info("loaded the best dev checkpoint (step %d, %.4f)", state.best["step"], state.best["value"])
        final_state = self.dist.model_state(self.loss_fn.model)  # FSDP: the full weights (every rank takes part)
        if self.dist.is_main:
            save_final(cfg, self.run.model, self.run.tokenizer, method, final_state, self.task)
        dev = self.run.evaluate(self.run.model, self.run.dev)[0] if self.run.dev else {}
        return {"trainable_params": sum(p.numel() for _, p in method.named_params), "steps": state.step,
                "train_runtime_s": round(runtime, 3),
                "steps_per_second": round(state.step / runtime, 4) if runtime > 0 else None, "resumes": state.resumes,
                "train_loss": state.last_loss, "peak_memory_mb": round(perf.peak_memory_mb(self.run.device), 1),
                **{f"dev_{k}": v for k, v in dev.items()},
                "boosters": len(method.boosting.history) if method.boosting is not None else 0,
                **self.dist.summary()}
