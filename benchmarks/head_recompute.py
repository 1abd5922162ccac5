"""The fused LM head's last chunk kept for the backward against every chunk recomputed (the code it replaced,
re-created here): the same SFT step (`xgblora bench --suite sft`'s xgblora side: GSM8K chats, LoRA r=8 on every
linear layer, token-mean loss, AdamW), timed step by step in turn on the same model, and the memory each adds in a
fresh process.

    python benchmarks/head_recompute.py --data_dir ../shared/data                     # 32k: one chunk a batch
    python benchmarks/head_recompute.py --data_dir ../shared/data --model_name llama-100m-128k-random
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from xgblora.bench import sft
from xgblora.bench.memory import peak_added
from xgblora.models import fused_head

VARIANTS = ("last kept", "all recomputed")
KEPT = fused_head._chunked


def all_recomputed(hidden, head, targets, chunk, temperature, statistics):  # noqa: ANN001
    """The replaced `_chunked`: every chunk under a checkpoint, the last one too."""
    chunk = chunk or fused_head.chunk_tokens(head)
    run = functools.partial(fused_head._chunk_scores, head, temperature=temperature, statistics=statistics)
    parts = [checkpoint(run, hidden[s:s + chunk], targets[s:s + chunk], use_reentrant=False)
             for s in range(0, hidden.shape[0], chunk)]
    return [torch.cat(column) for column in zip(*parts, strict=True)]


def use(variant: str) -> None:
    fused_head._chunked = KEPT if variant == VARIANTS[0] else all_recomputed


def case(args: argparse.Namespace) -> sft.SFTCase:
    return sft.SFTCase(model_name=args.model_name, packed=args.packed, checkpointing=False,
                       batch_size=args.batch_size, steps=args.steps, warmup=1, data_dir=args.data_dir)


def batches(c: sft.SFTCase) -> Iterator[list[int]]:
    for step in range(c.warmup + c.steps):
        yield sft.step_rows(c, step)


def timed(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each step's rows once per variant, the order turned each step; the warm-up step untimed."""
    c = case(args)
    ours = sft.XgbloraSFT(c, sft.sft_seqs(c))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step, rows in enumerate(batches(c)):
        for variant in VARIANTS[::1 if step % 2 else -1]:
            use(variant)
            start = time.perf_counter()
            ours.step(rows)
            if step >= c.warmup:
                times[variant].append(round(time.perf_counter() - start, 3))
    return times


def memory(args: argparse.Namespace, variant: str) -> float:
    """In this (fresh) process: what two steps of the variant add (MiB)."""
    use(variant)
    c = case(args)
    ours = sft.XgbloraSFT(c, sft.sft_seqs(c))
    with peak_added(ours.device) as mem:
        for rows in list(batches(c))[:2]:
            ours.step(rows)
    return round(mem["added"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name", default="llama-100m-random")
    parser.add_argument("--data_dir", default="")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(memory(args, args.worker)))
        return
    times = timed(args)
    mem = {v: json.loads(subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", v], check=True,
                                        capture_output=True, text=True).stdout.splitlines()[-1]) for v in VARIANTS}
    kept, old = (statistics.mean(times[v]) for v in VARIANTS)
    print(json.dumps({**{k: v for k, v in vars(args).items() if k != "worker"}, "step_s": times,
                      "speedup": round(old / kept, 3), "memory_added_mb": mem}, indent=1))


if __name__ == "__main__":
    main()
