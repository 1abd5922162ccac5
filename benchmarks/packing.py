"""Padding-free packing against length-grouped padding: the same training batches, timed side by side.

Real rows of a task (its gold continuations, tokenised as `xgblora train` does), an epoch's batches as the loop
draws them (with and without length grouping), and for each batch a LoRA AdamW step and a dual MeZO step on the
padded batch and on the packed one, interleaved. Reports the padding share of the padded batches and
packed / padded step time; below 1 packing pays. The model must keep packed sequences apart (a Llama-family
model; `scoring.packing_supported`).

    python benchmarks/packing.py --data_dir ../shared/data --model_name tiny-llama
    python benchmarks/packing.py --data_dir ../shared/data --model_name llama-1b-random --batch_size 8 --steps 3 \
        --num_train 256
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from xgblora.adapters.lora import attach, is_adapter_param
from xgblora.bench.timing import time_interleaved
from xgblora.config import Config
from xgblora.data.order import epoch_batches
from xgblora.data.splits import sample_splits
from xgblora.data.tasks import get_task
from xgblora.models import pretrained
from xgblora.models.scoring import packing_supported
from xgblora.optim.fo import AdamWStepper
from xgblora.optim.zo import MeZO, ZOStepper
from xgblora.train.objective import TrainingLoss, causal_training_set


def steps_of(model: torch.nn.Module, modules: dict, batch_size: int) -> dict:
    """One LoRA AdamW step and one dual MeZO step (the steppers of `xgblora train`), as functions of a batch."""
    named = [(n, p) for n, p in model.named_parameters() if is_adapter_param(n)]
    adamw_stepper = AdamWStepper(named, TrainingLoss(model), max_grad_norm=0.0, micro_batch=batch_size)
    zo_stepper = ZOStepper(MeZO(named, lr=1e-5, eps=1e-3, dual_modules=modules), TrainingLoss(model))

    def adamw(batch):
        model.train()
        adamw_stepper.step(lambda: batch, lr=1e-4)

    def mezo(batch):
        model.eval()
        zo_stepper.step(lambda: batch, lr=1e-5)

    return {"adamw": adamw, "mezo": mezo}


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; print and return its figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--task_name", default="SST2")
    parser.add_argument("--model_name", default="tiny-llama")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--num_train", type=int, default=512)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="Batches timed per setting (after 2 untimed).")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    model, tokenizer = pretrained.load(args.model_name, dtype=args.dtype)
    if not packing_supported(model):
        raise SystemExit(f"{args.model_name} lets packed sequences attend to each other: nothing to compare")
    modules = attach(model, r=8).modules
    cfg = Config(task_name=args.task_name, data_dir=args.data_dir, num_train=args.num_train, num_eval=1)
    examples = sample_splits(get_task(args.task_name, cfg), cfg).train
    sets = {packed: causal_training_set(tokenizer, examples, args.max_length, False, packed)
            for packed in (False, True)}
    lengths = sets[False].lengths
    steps = steps_of(model, modules, args.batch_size)
    out: dict = {"model": args.model_name, "dtype": args.dtype, "task": args.task_name, "batch_size": args.batch_size,
                 "threads": torch.get_num_threads(), "mean_tokens_per_example": statistics.fmean(lengths)}
    for grouped in (True, False):
        batches = epoch_batches(lengths, args.batch_size, seed=0, epoch=0, group_by_length=grouped)[:args.steps + 2]
        padded = [sets[False].batch(b) for b in batches]
        packed = [sets[True].batch(b) for b in batches]
        real = sum(int(b.attention_mask.sum()) for b in padded)
        tag = "grouped" if grouped else "shuffled"
        out[f"{tag}_padding_share"] = 1 - real / sum(b.input_ids.numel() for b in padded)
        for kind, step in steps.items():
            feeds = {"padded": iter(padded), "packed": iter(packed)}
            times = time_interleaved({name: lambda f=feed, s=step: s(next(f)) for name, feed in feeds.items()},
                                     repeats=args.steps, warmup=2, device=torch.device("cpu"))
            padded_s, packed_s = sum(times["padded"]), sum(times["packed"])
            out[f"{tag}_{kind}_padded_tokens_per_s"] = sum(int(b.attention_mask.sum()) for b in padded[2:]) / padded_s
            out[f"{tag}_{kind}_packed_over_padded"] = packed_s / padded_s
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
