"""Data parallelism across the processes of `torchrun` or `accelerate launch`: Accelerate wiring, batch shards,
gradient and loss averaging, and MeZO by seed sharing (only the two losses cross the wire).

Every rank builds the same global batch of `per_device_train_batch_size x world_size` examples (the same
batch order, the same seed) and trains on its contiguous shard of it, so N ranks x b see exactly the data of
1 rank x N*b. Each shard's `loss_scale` is its share of the global batch (n_r * world / n), so a plain
mean over ranks is the mean over the global batch, also for a short last batch of an epoch. A rank whose shard is
empty (a global batch smaller than the world) runs one example with weight 0, so every rank takes part in each
collective.

With one process (WORLD_SIZE unset or 1) nothing here creates an Accelerator or touches torch.distributed:
`LOCAL` hands every call back unchanged.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from xgblora.config import RFTConfig, TrainerConfig
from xgblora.data.batches import Batch
from xgblora.errors import RankLostError, UserError

log = logging.getLogger("xgblora")

BUCKET_BYTES = 25 * 2**20  # gradients are averaged in flat buckets of this size (DDP's default bucket size)


class Distributed:
    """This process's place in a data-parallel run; every method is a no-op hand-back with one process."""

    def __init__(self, accelerator: Any = None, timeout_s: float = 0.0):
        self.accelerator = accelerator
        self.world_size = accelerator.num_processes if accelerator is not None else 1
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.is_main = self.rank == 0
        self.timeout_s = timeout_s
        self.sharded = False  # the model was wrapped by FSDP (gradients reduce-scattered by FSDP itself)
        self.device: str | None = None  # this rank's GPU, when it has one
        self.model_only_checkpoints = False  # FSDP: checkpoints hold the gathered weights only
        self.bytes_per_step: list[int] = []  # all-reduce payload bytes of each training step, this run
        self.zo_bytes_per_step: list[int] = []  # of which a zeroth-order estimator's losses
        self._pending_bytes = self._pending_zo_bytes = 0

    # ------------------------------------------------------------------ data
    def shard(self, train_set: Any) -> Any:
        """The same training set whose batch(global indices) collates this rank's contiguous shard, with its weight."""
        if self.world_size == 1:
            return train_set

        def batch(indices: Sequence[int]) -> Batch:
            mine, scale = self.shard_of(indices)
            return dataclasses.replace(train_set.batch(mine), loss_scale=scale)

        return dataclasses.replace(train_set, batch=batch)

    def shard_of(self, indices: Sequence[int]) -> tuple[list[int], float]:
        """This rank's contiguous slice of a global batch (sizes differ by at most one) and its loss scale."""
        n, world = len(indices), self.world_size
        size, extra = divmod(n, world)
        start = self.rank * size + min(self.rank, extra)
        mine = list(indices[start:start + size + (self.rank < extra)])
        if not mine:  # more ranks than examples: run one example that does not count
            return list(indices[:1]), 0.0
        return mine, len(mine) * world / n

    # ------------------------------------------------------------------ model
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                named_params: list[tuple[str, nn.Parameter]]) -> tuple[nn.Module, torch.optim.Optimizer]:
        """AdamW on the whole model under an FSDP accelerate config: shard model and optimizer; else hand back.

        Everything else (LoRA, XGBLoRA, full fine-tuning without FSDP) is not wrapped in DDP: its gradients are
        averaged once per step by reduce_step(). DDP needs every rank to run the same backward passes over the
        same set of parameters that require grad, fixed when it is built; here XGBLoRA's layer sampling flips
        requires_grad between boosters, a CUDA out-of-memory error halves the micro-batch on one rank only (more
        backward passes there), and shards of a short last batch differ in size. Adapter gradients are small, so
        losing DDP's overlap of communication with the backward pass costs little.
        On FSDP the sharded parameters replace named_params' entries in place (clipping and checkpoints see them);
        FSDP does need the same backward passes on every rank, so there an out-of-memory retry on one rank ends
        the run with RankLostError once --ddp_timeout passes.
        """
        if self.world_size == 1 or not self._fsdp:
            return model, optimizer
        model, optimizer = self.accelerator.prepare(model, optimizer)
        named_params[:] = list(self.accelerator.unwrap_model(model).named_parameters())
        self.sharded = True
        return model, optimizer

    @property
    def shards_model(self) -> bool:
        """Whether prepare() wraps the model in FSDP (more than one process under an FSDP config)."""
        return self.world_size > 1 and self._fsdp

    @property
    def _fsdp(self) -> bool:
        from accelerate.utils import DistributedType

        return self.accelerator is not None and self.accelerator.distributed_type == DistributedType.FSDP

    def model_state(self, model: nn.Module) -> dict[str, Tensor] | None:
        """FSDP: the whole model's state dict, gathered on the main process (all ranks call it); else None."""
        return self.accelerator.get_state_dict(model) if self.sharded else None

    def full_state(self, tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        """The given trainable tensors, gathered whole on the main process when FSDP shards them (all ranks call it)."""
        full = self.model_state(model)
        return tensors if full is None else {k: full[k] for k in tensors if k in full}

    # ------------------------------------------------------------------ collectives
    def reduce_step(self, loss: Tensor, params: Iterable[nn.Parameter]) -> Tensor:
        """After an AdamW step's backward passes: average the gradients (unless FSDP did) and the loss over ranks."""
        if self.world_size == 1:
            return loss
        tensors = [loss.reshape(1)]
        if not self.sharded:
            tensors += [p.grad for p in params if p.grad is not None]
        self._all_reduce_mean(tensors, "the gradient all-reduce")
        return loss

    def all_mean(self, values: Tensor) -> Tensor:
        """The mean over ranks of a small tensor (MeZO's L+ and L-), as a new tensor."""
        if self.world_size == 1:
            return values
        values = values.clone()
        self._all_reduce_mean([values], "the loss all-reduce")
        return values

    def all_sum(self, values: Tensor) -> Tensor:
        """The sum over ranks of a small tensor (ES's member losses, each scored on one rank), as a new tensor."""
        if self.world_size == 1:
            return values
        values = values.clone()
        self._collective(lambda: torch.distributed.all_reduce(values), values.nbytes, "the loss all-reduce")
        return values

    def zo_losses(self, total: bool = False) -> Callable[[Tensor], Tensor]:
        """A zeroth-order estimator's reduce_losses: the mean over ranks (each scored its share of the batch) or,
        with total, the sum (each scored its share of the members, 0 for the others'); counted in
        zo_bytes_per_step."""
        reduce = self.all_sum if total else self.all_mean

        def reduced(values: Tensor) -> Tensor:
            if self.world_size > 1:
                self._pending_zo_bytes += values.nbytes
            return reduce(values)

        return reduced

    def gather_rows(self, rows: Tensor) -> tuple[Tensor, int]:
        """Every rank's rows concatenated in rank order, and where this rank's start (the contrastive loss's shared
        negatives). Rows that need gradients travel through autograd's all-gather, whose backward sends each rank
        the gradient of its own rows from every rank's loss: the gradient of the global batch's loss once the
        ranks' gradients are averaged. Ranks may hold different numbers of rows (padded for the collective)."""
        if self.world_size == 1:
            return rows, 0
        sizes = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(self.world_size)]
        mine = torch.tensor([rows.shape[0]], device=rows.device)
        self._collective(lambda: torch.distributed.all_gather(sizes, mine), mine.nbytes, "the row-count gather")
        counts = [int(n) for n in sizes]
        padded = nn.functional.pad(rows, (0, 0) * (rows.dim() - 1) + (0, max(counts) - rows.shape[0]))
        parts: list[Tensor] = [torch.empty_like(padded) for _ in counts]
        if rows.requires_grad:
            from torch.distributed.nn.functional import all_gather

            def gather() -> None:
                parts[:] = all_gather(padded)
        else:
            def gather() -> None:
                torch.distributed.all_gather(parts, padded)
        self._collective(gather, padded.nbytes, "the embedding gather")
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]), sum(counts[:self.rank])

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's picklable value, in rank order (checkpoint state that differs per rank; tensors on the CPU)."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        self._collective(lambda: torch.distributed.all_gather_object(values, value), 0, "the state gather")
        return values

    def end_step(self, stop: bool) -> bool:
        """End of a training step: whether any rank asked to stop (SIGINT/SIGTERM), agreed by all ranks."""
        if self.world_size == 1:
            return stop
        flag = torch.tensor([int(stop)], dtype=torch.int32, device=self._device)
        self._collective(lambda: torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX), flag.nbytes,
                         "the stop-flag all-reduce")
        self.bytes_per_step.append(self._pending_bytes)
        self.zo_bytes_per_step.append(self._pending_zo_bytes)
        self._pending_bytes = self._pending_zo_bytes = 0
        return bool(flag.item())

    def wait_for_main(self) -> None:
        """Every rank waits here until the main process has written what the others are about to read."""
        if self.world_size > 1:
            self._collective(torch.distributed.barrier, 0, "the barrier")

    def summary(self) -> dict[str, Any]:
        """Run statistics of a multi-process run (nothing with one process): world size, bytes sent per step."""
        if self.world_size == 1:
            return {}
        steps, zo = self.bytes_per_step, self.zo_bytes_per_step
        return {"world_size": self.world_size, "fsdp": self.sharded,
                "allreduce_bytes_per_step": round(sum(steps) / len(steps), 1) if steps else 0.0,
                **({"zo_bytes_per_step": round(sum(zo) / len(zo), 1)} if any(zo) else {})}

    @property
    def _device(self) -> torch.device:
        return self.accelerator.device

    def _all_reduce_mean(self, tensors: list[Tensor], what: str) -> None:
        """Average tensors over ranks in place: one all-reduce per flat bucket of one dtype, up to BUCKET_BYTES."""
        bucket: list[Tensor] = []
        size = 0
        for t in [*tensors, None]:
            if bucket and (t is None or t.dtype != bucket[0].dtype or t.device != bucket[0].device
                           or size + t.nbytes > BUCKET_BYTES):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                self._collective(lambda flat=flat: torch.distributed.all_reduce(flat), flat.nbytes, what)
                flat.div_(self.world_size)
                for b, part in zip(bucket, flat.split([b.numel() for b in bucket]), strict=True):
                    b.copy_(part.view_as(b))
                bucket, size = [], 0
            if t is not None:
                bucket.append(t)
                size += t.nbytes

    def _collective(self, call: Callable[[], Any], nbytes: int, what: str) -> None:
        """Run one collective, count its payload, and turn a lost rank into one clear error."""
        try:
            call()
        except RuntimeError as exc:  # gloo/NCCL: a closed connection, or no answer within the timeout
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RankLostError(f"rank {self.rank} of {self.world_size}: {what} failed, so another rank died, was "
                                f"killed or stalled for longer than --ddp_timeout {self.timeout_s:g} s; stopping "
                                f"this rank too ({first})") from None
        self._pending_bytes += nbytes


LOCAL = Distributed()  # one process: every call hands its argument back


def setup(cfg: TrainerConfig | RFTConfig) -> Distributed:
    """Join the process group that torchrun / accelerate launch describe in the environment (none: LOCAL).

    The Accelerator picks the backend (NCCL on GPUs, gloo on the CPU), this rank's GPU (`device`) and, from an
    accelerate config, FSDP. Ranks other than the main one log warnings only.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LOCAL
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    accelerator = Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(
        seconds=cfg.ddp_timeout))])
    atexit.register(accelerator.end_training)
    dist = Distributed(accelerator, cfg.ddp_timeout)
    if not dist.is_main:
        log.setLevel(logging.WARNING)
    if accelerator.device.type != "cpu":
        dist.device = str(accelerator.device)
    if dist._fsdp:
        dist.model_only_checkpoints = _check_fsdp(cfg, accelerator)
    log.info("data parallel: %d processes (%s), global batch %d", dist.world_size, accelerator.distributed_type,
             cfg.per_device_train_batch_size * dist.world_size)
    return dist


def _check_fsdp(cfg: TrainerConfig, accelerator: Any) -> bool:
    """FSDP shards full fine-tuning under AdamW; say what it does not do; whether checkpoints are model-only."""
    if cfg.method != "ft" or cfg.trainer != "regular":
        log.info("FSDP shards full fine-tuning under AdamW only; this run trains data-parallel without it")
        return False
    if not accelerator.is_fsdp2:
        raise UserError("FSDP: set fsdp_version: 2 in the accelerate config (see examples/accelerate/fsdp.yaml)")
    if cfg.load_best_model_at_end:
        raise UserError("--load_best_model_at_end is not supported under FSDP (the sharded model cannot load a "
                        "full checkpoint); drop it, or train on one device or with DDP")
    if not cfg.save_only_model:
        log.warning("FSDP: checkpoints hold the gathered weights only (--save_only_model); a resume restarts the "
                    "optimizer state")
    return True


class SilentLog:
    """The metrics log of ranks other than the main one: records are dropped (the main process writes them)."""

    def __enter__(self) -> SilentLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, record: dict) -> None:
        """Drop one record."""

    def flush(self) -> None:
        """Nothing to write."""

    def close(self) -> None:
        """Nothing to close."""
