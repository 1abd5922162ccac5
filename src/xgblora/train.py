"""One run from a config: data, model, method, then the training loop (AdamW or MeZO) or evaluation only."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from xgblora import checkpoint, distributed, encoders, models, perf
from xgblora import config as config_mod
from xgblora.adapters import export
from xgblora.adapters.boosting import Boosting
from xgblora.adapters.lora import LoRALinear, attach, prepare_full_ft
from xgblora.config import Config
from xgblora.data.batching import epoch_batches, packing_supported, split_packed
from xgblora.data.loading import sample_splits
from xgblora.data.tasks import get_task
from xgblora.errors import UserError
from xgblora.evaluate import evaluate
from xgblora.logging import MetricsLog, setup_console_logging
from xgblora.objective import TrainingSet, causal_training_set, label_training_set, per_example_loss
from xgblora.optim import fo
from xgblora.optim.zo import MeZO

log = logging.getLogger("xgblora")


# ----------------------------------------------------------------------------- results

def result_file_tag(cfg: Config) -> str:
    """MeZO's result file stem: {TASK}-{MODEL}[-sfc][-icl_sfc][-sampleevalN][-ntrainN][-ndevN][-tag]."""
    tag = f"{cfg.task_name}-{cfg.model_name.rstrip('/').split('/')[-1]}"
    tag += "-sfc" if cfg.sfc else ""
    tag += "-icl_sfc" if cfg.icl_sfc else ""
    tag += f"-sampleeval{cfg.num_eval}" if cfg.num_eval is not None else ""
    tag += f"-ntrain{cfg.num_train}" if cfg.num_train > 0 else ""
    tag += f"-ndev{cfg.num_dev}" if cfg.num_dev is not None else ""
    tag += f"-{cfg.tag}" if cfg.tag else ""
    return tag


def write_results(cfg: Config, results: dict[str, Any]) -> None:
    """Write results.json into the output folder and MeZO's copy (--result_file, or result/<tag>-trainset<i>.json)."""
    text = json.dumps(results, indent=2, sort_keys=True) + "\n"
    (Path(cfg.output_dir) / "results.json").write_text(text, encoding="utf-8")
    name = f"{result_file_tag(cfg)}-trainset{cfg.train_set_seed}.json"
    copy = Path(cfg.result_file) if cfg.result_file else Path("result") / name
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text, encoding="utf-8")


# ----------------------------------------------------------------------------- what trains

@dataclass
class Method:
    """The trainable part of the model: named parameters, adapters (if any) and the XGBLoRA schedule (if any)."""

    named_params: list[tuple[str, torch.nn.Parameter]]
    modules: dict[str, LoRALinear] = field(default_factory=dict)
    boosting: Boosting | None = None

    def trainable_state(self, with_bases: bool) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint must hold; with_bases adds the (merged-into) base weights of adapted modules."""
        state = dict(self.named_params)
        if with_bases:
            state.update({f"{name}.base.weight": m.base.weight for name, m in self.modules.items()})
        return state


def setup_method(model: torch.nn.Module, cfg: Config) -> Method:
    """Prepare full fine-tuning, LoRA, or XGBLoRA boosters on the model, and say what trains."""
    if cfg.method == "ft":
        count = prepare_full_ft(model)
        log.info("full fine-tuning: %s trainable parameters", f"{count:,}")
        return Method(list(model.named_parameters()))
    targets = cfg.lora_target_modules.split(",") if cfg.lora_target_modules else None
    report = attach(model, targets, r=cfg.rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout)
    log.info("%s", report)
    named = [(n, p) for n, p in model.named_parameters()
             if ".lora_" in n or n.split(".")[0] in encoders.CLASSIFIER_MODULES]
    for _, p in named:  # adapters, and a new classification head: it trains in every method
        p.requires_grad_(True)
    boosting = None
    if cfg.method == "xgblora":
        boosting = Boosting(report.modules, cfg.xgblora_steps_per_iteration, cfg.xgblora_layers_per_booster,
                            cfg.xgblora_shrinkage, cfg.xgblora_adaptive, cfg.xgblora_adaptive_patience,
                            cfg.xgblora_adaptive_threshold, cfg.xgblora_adaptive_ema, seed=cfg.seed)
        boosting.begin()
    return Method(named, report.modules, boosting)


# ----------------------------------------------------------------------------- data order

@dataclass
class BatchStream:
    """Endless training batches of example indices; (epoch, cursor) is all a resumed run needs to continue exactly."""

    lengths: list[int]
    batch_size: int
    seed: int
    group_by_length: bool
    epoch: int = 0
    cursor: int = 0

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batches = epoch_batches(self.lengths, self.batch_size, self.seed, self.epoch, self.group_by_length)
            while self.cursor < len(batches):
                self.cursor += 1
                yield batches[self.cursor - 1]
            self.epoch, self.cursor = self.epoch + 1, 0


class StopRequested(KeyboardInterrupt):
    """SIGINT/SIGTERM arrived: the loop saves a checkpoint and stops."""


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


# ----------------------------------------------------------------------------- the run

def run(cfg: Config) -> dict[str, Any]:
    """Run what cfg asks for and return the final metrics (also written to results.json)."""
    setup_console_logging()
    dist = distributed.setup(cfg)  # before the model loads: it picks this rank's GPU
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.trainer != "none" and (out / "results.json").exists() and not cfg.overwrite_output_dir \
            and not cfg.resume_from_checkpoint:
        raise UserError(f"{out} already holds a finished run; pass --overwrite_output_dir to redo it, "
                        f"or another --output_dir")
    if dist.is_main:
        config_mod.dump(cfg, out / "config.yaml")
    transformers.set_seed(cfg.seed)
    task = get_task(cfg.task_name, cfg)
    splits = sample_splits(task, cfg)
    head = models.resolve_head(cfg.head, cfg.model_name, cfg.trust_remote_code)
    words = encoders.label_words(task.name, splits.train, splits.dev, splits.eval) if head != "lm" else ()
    if head != "lm" and (cfg.sfc or cfg.icl_sfc):
        raise UserError(f"--sfc/--icl_sfc calibrate a causal LM's candidate scores; --head {head} has no surface forms")
    model, tokenizer = models.load(cfg.model_name, dtype=cfg.dtype_name, attn_implementation=cfg.attn_implementation,
                                   device=cfg.device, trust_remote_code=cfg.trust_remote_code, head=head,
                                   num_labels=len(words) or None)
    scoring = encoders.build_scoring(head, tokenizer, words) if head != "lm" else None
    device = next(model.parameters()).device
    if cfg.tf32:
        perf.enable_tf32(device)
    if device.type == "cpu" and (cfg.bf16 or cfg.dtype_name != "float32") and not perf.cpu_has_bf16():
        log.warning("this CPU has no native bf16 arithmetic (no avx512_bf16, AMX or Arm bf16): half precision runs "
                    "emulated, 24x slower than fp32 for an all-MiniLM-L6-v2 training step on a 2-core AMD EPYC; "
                    "drop --bf16 / --load_bfloat16 / --load_float16 on this machine")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and cfg.max_length > positions:
        log.debug("max_length %d exceeds %s's %d positions; using %d", cfg.max_length, cfg.model_name, positions,
                  positions)
        cfg.max_length = positions

    def score(examples, demos=()) -> dict[str, float]:
        if scoring is not None:  # no in-context demonstrations: the label is read from one input
            return encoders.evaluate(model, tokenizer, examples, scoring, batch_size=cfg.per_device_eval_batch_size,
                                     max_length=cfg.max_length)
        return evaluate(model, tokenizer, task, examples, demos=demos, sfc=cfg.sfc, icl_sfc=cfg.icl_sfc,
                        batch_size=cfg.per_device_eval_batch_size, max_length=cfg.max_length,
                        max_new_tokens=cfg.max_new_tokens)

    base = {"task": task.name, "model": cfg.model_name, "head": head, "trainer": cfg.trainer, "seed": cfg.seed,
            "num_eval": len(splits.eval), "device": str(device), "torch": torch.__version__}
    if cfg.trainer == "none":
        if head == "classifier":
            log.warning("--head classifier without training scores with a new, untrained head: expect chance accuracy")
        started = time.perf_counter()
        demos = splits.train if scoring is None else ()  # a label head reads one input: no in-context demonstrations
        results = {**score(splits.eval, demos), **base, "method": "none", "num_demos": len(demos),
                   "eval_runtime_s": round(time.perf_counter() - started, 3)}
        if dist.is_main:
            write_results(cfg, results)
        return results
    if not splits.train:
        raise UserError(f"--trainer {cfg.trainer} needs training examples: --num_train is {cfg.num_train}")
    if cfg.train_as_classification and task.generation and head == "lm":
        raise UserError(f"--train_as_classification needs answer candidates; {task.name} is a generation task "
                        f"(train it on the answer tokens, the default)")

    packed = _packing(cfg, model, head, device)
    method = setup_method(model, cfg)
    train_set = label_training_set(tokenizer, splits.train, cfg.max_length, scoring) if scoring is not None else \
        causal_training_set(tokenizer, splits.train, cfg.max_length, cfg.train_as_classification, packed)
    summary = _train(cfg, model, tokenizer, splits, train_set, method, score, device, dist)
    results = {**base, **summary, "method": cfg.method, "num_train": len(splits.train)}
    if not cfg.no_eval:
        results.update(score(splits.eval))  # every rank evaluates (FSDP needs them all); the main one writes
    if dist.is_main:
        write_results(cfg, results)
    return results


def _train(cfg: Config, model, tokenizer, splits, train_set: TrainingSet, method: Method, score,
           device: torch.device, dist: distributed.Distributed) -> dict[str, Any]:
    """The loop: batch -> step (AdamW or MeZO) -> boosting -> log -> eval -> checkpoint; returns run statistics."""
    train_set = dist.shard(train_set)  # batch(global batch) collates this rank's shard of it
    global_batch = cfg.per_device_train_batch_size * dist.world_size
    out = Path(cfg.output_dir)
    ckpt_root = out / "checkpoints"
    lengths = train_set.lengths
    stream = BatchStream(lengths, global_batch, cfg.seed, cfg.group_by_length)
    batches_per_epoch = math.ceil(len(lengths) / global_batch)
    max_steps = cfg.max_steps if cfg.max_steps > 0 else \
        math.ceil(cfg.num_train_epochs * batches_per_epoch / cfg.gradient_accumulation_steps)
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * max_steps)
    trainable = sum(p.numel() for _, p in method.named_params)

    autocast_dtype = _autocast_dtype(cfg, device)
    if cfg.gradient_checkpointing and cfg.trainer == "regular":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forward_model = torch.compile(model) if cfg.compile else model

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            return per_example_loss(forward_model, batch)

    loss_fn = dist.weighted(loss_fn)  # this rank's share of the global batch: the mean over ranks is global
    if cfg.trainer == "regular":
        optimizer = fo.build_optimizer(method.named_params, cfg.learning_rate, cfg.weight_decay,
                                       (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_epsilon,
                                       fused=None if cfg.fused_adamw else False)
        scheduler = fo.build_scheduler(optimizer, cfg.lr_scheduler_type, max_steps, warmup)
        zo, micro = None, MicroBatching(cfg.per_device_train_batch_size)
    else:  # MeZO: the schedule drives its lr through a stand-in optimizer, so both trainers share one schedule code
        optimizer, lr_holder = None, torch.optim.SGD([torch.zeros(1)], lr=cfg.learning_rate)
        scheduler = fo.build_scheduler(lr_holder, cfg.lr_scheduler_type, max_steps, warmup)
        # the doubled batch carries adapter perturbations only: not a full model, a trainable head, or grouped rows
        dual = cfg.zo_dual and bool(method.modules) and not cfg.train_as_classification \
            and all(".lora_" in n for n, _ in method.named_params)
        # the norm penalty l(|A|^2 + |B|^2) has the exact gradient 2l*theta: under MeZO it is weight decay 2l
        decay = cfg.weight_decay + (2 * cfg.xgblora_norm_penalty if method.boosting is not None else 0.0)
        zo = MeZO(method.named_params, cfg.learning_rate, cfg.zo_eps, decay, cfg.zo_stochastic_rounding,
                  dual_modules=method.modules if dual else None, seed=cfg.seed, reduce_losses=dist.all_mean)

    step, best, window = 0, None, (0.0, 0.0, 0)  # logging window: sum of finite losses, their count, steps
    if cfg.resume_from_checkpoint:
        path = checkpoint.resolve(ckpt_root, cfg.resume_from_checkpoint)
        tensors, state, blobs = checkpoint.load(path)
        model.load_state_dict(tensors, strict=False)
        step, best = state["step"], state["best"]
        window = tuple(state.get("window", window))  # losses of the logging window in flight at the checkpoint
        stream.epoch, stream.cursor = state["epoch"], state["cursor"]
        checkpoint.set_rng_state(state["rng"])
        if optimizer is not None and "optimizer" in blobs:
            optimizer.load_state_dict(blobs["optimizer"])
        if "scheduler" in blobs:
            scheduler.load_state_dict(blobs["scheduler"])
        if zo is not None and "zo" in blobs:
            zo.load_state_dict(blobs["zo"])
        if method.boosting is not None and "boosting" in blobs:
            method.boosting.load_state_dict(blobs["boosting"])
        log.info("resumed from %s at step %d", path, step)
    forward_model, optimizer = dist.prepare(forward_model, optimizer, method.named_params)  # FSDP, after loading
    metrics_path = out / "metrics.jsonl"
    metrics = MetricsLog(metrics_path, tensorboard_dir=out / "tensorboard" if cfg.report_to == "tensorboard" else None,
                         resume=step > 0, resume_step=step if step > 0 else None) if dist.is_main \
        else distributed.SilentLog()

    def save(name: str) -> Path:
        metrics.flush()
        state = {"step": step, "epoch": stream.epoch, "cursor": stream.cursor, "best": best,
                 "window": [float(window_loss), float(window_finite), window_steps], "rng": checkpoint.rng_state()}
        blobs: dict[str, Any] = {}
        if not cfg.save_only_model:
            blobs["scheduler"] = scheduler.state_dict()
            if optimizer is not None:
                blobs["optimizer"] = optimizer.state_dict()
            if zo is not None:
                blobs["zo"] = zo.state_dict()
        if method.boosting is not None:  # the booster history is part of the model: final/ exports it
            blobs["boosting"] = method.boosting.state_dict()
        tensors = dist.full_state(method.trainable_state(with_bases=method.boosting is not None), forward_model)
        return checkpoint.save(ckpt_root, name, tensors, state, blobs) if dist.is_main else ckpt_root / name

    batches = iter(stream)

    def next_batch() -> dict[str, torch.Tensor]:
        return _to(train_set.batch(next(batches)), device)

    started, last_loss = time.perf_counter(), float("nan")
    window_loss, window_finite = (torch.tensor(v, dtype=torch.float32, device=device) for v in window[:2])
    window_steps = int(window[2])
    progress = tqdm(total=max_steps, initial=step, desc=f"{cfg.method}/{cfg.trainer}", dynamic_ncols=True,
                    disable=None if dist.is_main else True)
    model.train(cfg.trainer == "regular")  # MeZO's forwards run in eval mode: no dropout between L+ and L-
    with graceful_stop() as stop:
        try:
            while step < max_steps:
                lr = scheduler.get_last_lr()[0]
                if optimizer is not None:
                    loss = _adamw_step(cfg, method, optimizer, loss_fn, next_batch, device, micro, dist)
                else:
                    plus, minus = zo.step(loss_fn, next_batch(), lr=lr)
                    loss = torch.tensor((plus + minus) / 2, device=device)
                    if not math.isfinite(plus - minus) and cfg.nan_policy == "skip":
                        log.warning("non-finite MeZO loss at step %d; update skipped (--nan_policy skip)", step + 1)
                    lr_holder.step()  # a no-op (no gradients) that keeps the scheduler's step order
                scheduler.step()
                step += 1
                finite = torch.isfinite(loss.detach())  # kept on the device: no host sync per step
                window_loss += torch.where(finite, loss.detach(), 0.0)
                window_finite += finite
                window_steps += 1
                if method.boosting is not None:
                    event = method.boosting.after_step(step, float(loss) if cfg.xgblora_adaptive else None, optimizer)
                    if event is not None:
                        metrics.log({**event, "step": step})
                if step % cfg.logging_steps == 0 or step == max_steps:
                    total, n_finite = torch.stack([window_loss, window_finite]).tolist()  # the one host sync
                    skipped = window_steps - int(n_finite)
                    window_loss.zero_()
                    window_finite.zero_()
                    window_steps = 0
                    if skipped and cfg.nan_policy == "stop":
                        raise UserError(f"training loss is nan or inf at step {step}; stopping. The last good "
                                        f"checkpoint is under {ckpt_root} (try a lower --learning_rate, or "
                                        f"--nan_policy skip)")
                    last_loss = total / n_finite if n_finite else float("nan")
                    record = {"step": step, "loss": last_loss if n_finite else None, "lr": lr}
                    metrics.log({**record, **({"skipped": skipped} if skipped else {}),
                                 "elapsed_s": round(time.perf_counter() - started, 3)})
                    progress.set_postfix(loss=f"{last_loss:.4f}", refresh=False)
                progress.update(1)
                if cfg.evaluation_strategy == "steps" and step % cfg.eval_steps == 0:
                    dev = score(splits.dev or splits.eval)
                    metrics.log({"step": step, **{f"eval_{k}": v for k, v in dev.items()}})
                    value = next(iter(dev.values()))
                    if best is None or value > best["value"]:
                        best = {"value": value, "step": step}
                        if cfg.load_best_model_at_end:
                            save("best")
                if cfg.save_strategy == "steps" and step % cfg.save_steps == 0 and step < max_steps:
                    save(f"step-{step}")
                    if dist.is_main:
                        checkpoint.prune(ckpt_root, cfg.save_total_limit)
                if dist.end_step(stop["stop"]):  # all ranks stop at the same step
                    path = save(f"step-{step}")
                    raise StopRequested(f"stopped at step {step}; checkpoint saved to {path}; "
                                        f"resume with --resume_from_checkpoint latest")
        finally:
            progress.close()
            metrics.close()
    runtime = time.perf_counter() - started
    dist.wait_for_main()  # its checkpoints are written before any rank reads "best"
    if cfg.load_best_model_at_end and best is not None and (ckpt_root / "best").is_dir():
        tensors, _, blobs = checkpoint.load(ckpt_root / "best")
        model.load_state_dict(tensors, strict=False)
        if method.boosting is not None:  # the boosters merged up to the best step, not those merged after it
            method.boosting.load_state_dict(blobs["boosting"])
        log.info("loaded the best dev checkpoint (step %d, %.4f)", best["step"], best["value"])
    final_state = dist.model_state(forward_model)  # FSDP: the full weights, gathered (every rank takes part)
    if dist.is_main:
        _save_final(cfg, model, tokenizer, method, final_state)
    return {"trainable_params": trainable, "steps": step, "train_runtime_s": round(runtime, 3),
            "steps_per_second": round(step / runtime, 4) if runtime > 0 else None, "train_loss": last_loss if math.isfinite(last_loss) else None,
            "peak_memory_mb": round(perf.peak_memory_mb(device), 1),
            **({f"dev_{k}": v for k, v in score(splits.dev).items()} if splits.dev and not cfg.no_eval else {}),
            "boosters": len(method.boosting.history) if method.boosting is not None else 0, **dist.summary()}


def _packing(cfg: Config, model: torch.nn.Module, head: str, device: torch.device) -> bool:
    """Whether training batches are packed: --packing, else on with flash attention; only where the model allows it.

    With sdpa/eager the packed row's block-diagonal mask makes attention cost the square of the whole row: on the
    CPU more than length grouping's few percent of padding on small models, a little less on 1B ones
    (BENCHMARKS.md); flash attention's varlen kernels compute no cross-sequence pairs.
    """
    if cfg.packing is False:
        return False
    attention = getattr(model.config, "_attn_implementation", "") or ""
    eligible = head == "lm" and not cfg.train_as_classification
    if cfg.packing is None and not (eligible and attention.startswith("flash")):
        return False
    if not eligible:
        raise UserError("--packing needs a causal LM trained on the gold continuation (not --head classifier/mlm or "
                        "--train_as_classification, whose candidates are scored side by side)")
    autocast = _autocast_dtype(cfg, device)
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):  # as the training forwards
        supported = packing_supported(model)
    if supported:
        log.info("packing each training batch into one row (no padding)")
        return True
    if cfg.packing:
        raise UserError(f"--packing: this model ({model.config.model_type}, {attention} attention) lets packed "
                        f"sequences attend to each other; use --packing false (length-grouped padding)")
    log.info("packing is off: %s with %s attention does not keep packed sequences apart", model.config.model_type,
             attention)
    return False


def _autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """bf16 autocast: on by default on CUDA devices that support it; --bf16 forces it; --fp16 on CUDA only."""
    if cfg.fp16:
        if device.type != "cuda":
            raise UserError("--fp16 autocast needs a CUDA device; on CPU use --bf16 (this CPU may support it)")
        return torch.float16
    use_bf16 = cfg.bf16 if cfg.bf16 is not None else (device.type == "cuda" and torch.cuda.is_bf16_supported())
    if not use_bf16 or cfg.dtype_name != "float32":
        return None
    return torch.bfloat16


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class MicroBatching:
    """Examples per forward/backward pass of an AdamW step: the batch size until CUDA runs out of memory."""

    size: int

    def halve(self, cfg: Config) -> None:
        """Halve the micro-batch after an out-of-memory error and say so; below one example, a UserError."""
        if self.size <= 1:
            raise UserError(f"CUDA out of memory with a micro-batch of 1 example (--max_length {cfg.max_length}); "
                            f"try --gradient_checkpointing, a smaller --max_length, or --trainer zo (MeZO keeps "
                            f"no gradients or optimizer state)")
        self.size = (self.size + 1) // 2
        pieces = math.ceil(cfg.per_device_train_batch_size / self.size) * cfg.gradient_accumulation_steps
        log.warning("CUDA out of memory: redoing the step with micro-batch %d and %d micro-batches per optimizer "
                    "step (the same global batch of %d and the same gradient)", self.size, pieces,
                    cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps)


def _pieces(batch: dict[str, torch.Tensor], size: int) -> Iterator[tuple[dict[str, torch.Tensor], float]]:
    """Cut a collated batch into pieces of at most `size` examples: (piece, its share of the batch's examples).

    Rows are examples, except in a classification batch: there "group" maps each candidate row to its example
    (rows of one example are adjacent) and "gold" has one entry per example; and in a packed batch, whose one row
    holds the examples end to end.
    """
    group = batch.get("group")
    packed = "target_index" in batch  # the key per_example_loss recognises a packed batch by
    n = len(batch["gold"]) if group is not None else batch["target_weight"].shape[1] if packed else \
        len(batch["input_ids"])
    if size >= n:
        yield batch, 1.0
        return
    for start in range(0, n, size):
        stop = min(start + size, n)
        if packed:
            yield split_packed(batch, start, stop), (stop - start) / n
            continue
        if group is None:
            yield {k: v[start:stop] for k, v in batch.items()}, (stop - start) / n
            continue
        rows = (group >= start) & (group < stop)
        piece = {k: v[start:stop] if k == "gold" else v[rows] for k, v in batch.items()}
        piece["group"] = piece["group"] - start
        yield piece, (stop - start) / n


def _adamw_step(cfg: Config, method: Method, optimizer, loss_fn, next_batch, device,
                micro: MicroBatching, dist: distributed.Distributed = distributed.LOCAL) -> torch.Tensor:
    """One AdamW step over gradient_accumulation_steps batches; returns the mean loss (a device tensor).

    Each batch goes forward and backward in micro-batches of at most micro.size examples, each loss weighted
    by its share of the batch, so the gradient is the whole batch's. On CUDA out-of-memory the step starts
    over from zero gradients with the micro-batch halved (twice the accumulation, the same gradient).
    """
    batches = [next_batch() for _ in range(cfg.gradient_accumulation_steps)]
    while True:
        try:
            total = _accumulate(cfg, method, loss_fn, batches, micro.size, device)
            break
        except torch.OutOfMemoryError:
            pass  # recovered below, once the error and the activations its traceback holds are released
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        micro.halve(cfg)
    total = dist.reduce_step(total, (p for _, p in method.named_params))  # gradients and loss: means over ranks
    params = [p for _, p in method.named_params if p.grad is not None]
    fo.clip_grad_norm(params, cfg.max_grad_norm)
    if cfg.nan_policy == "skip" and not torch.isfinite(total):
        log.warning("non-finite loss; step skipped (--nan_policy skip)")
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _accumulate(cfg: Config, method: Method, loss_fn, batches: list[dict[str, torch.Tensor]], size: int,
                device: torch.device) -> torch.Tensor:
    """Backward over the batches in micro-batches of at most `size` examples; returns the mean loss."""
    total = torch.zeros((), device=device)
    penalty = method.boosting is not None and cfg.xgblora_norm_penalty > 0
    for batch in batches:
        for piece, share in _pieces(batch, size):
            loss = loss_fn(piece).mean() * share / len(batches)
            if penalty:
                loss = loss + method.boosting.norm_penalty(cfg.xgblora_norm_penalty) * share / len(batches)
            loss.backward()
            total += loss.detach()
    return total


def _save_final(cfg: Config, model, tokenizer, method: Method, state: dict[str, torch.Tensor] | None = None) -> None:
    """final/: a PEFT adapter (boosters concatenated) for lora/xgblora, the whole model for full fine-tuning."""
    final = Path(cfg.output_dir) / "final"
    if method.modules:
        history = method.boosting.history if method.boosting is not None else []
        head = {n: p for n, p in method.named_params if ".lora_" not in n}
        export.to_peft(method.modules, history, final, cfg.model_name, head=head)
    else:
        model.save_pretrained(final, state_dict=state)
        tokenizer.save_pretrained(final)
