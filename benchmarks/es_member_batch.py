"""Evolution strategies' members sampled one at a time against K at a time (`--zo_member_batch K`): seconds per step
of the same ES run on SmolLM2-135M-Instruct, the grpo_smollm2 benchmark's addition task and its ES command (4
antithetic pairs, 8 prompts a step, greedy answers of up to 32 tokens, LoRA r=1 on q/v).

Each run is a fresh `xgblora grpo` of --steps steps in its own process; the two settings alternate (1, K, 1, K, ...)
so that a drift of the machine's speed falls on both. A step's seconds come from the run's metrics log (the loop's
own clock); the first step of each run is left out (its answers are the longest: the format is not learned yet).
Both settings draw the same answers (the members' seeds and per-prompt sampling seeds are the same), which the
script checks from the logged rewards. The peak RSS of each run is the process's own.

    OMP_NUM_THREADS=1 python benchmarks/es_member_batch.py --out bench-es-batch --member_batch 8 --runs 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_once(args: argparse.Namespace, batch: int, number: int) -> dict:
    """One grpo_smollm2 ES run of --steps steps with `batch` members per generation: its per-step seconds, rewards
    and peak RSS."""
    out = Path(args.out) / f"batch{batch}-run{number}"
    command = [sys.executable, str(HERE / "grpo_smollm2.py"), "--out", str(out), "--trainer", "zo",
               "--zo_objective", "reward", "--zo_estimator", "es", "--zo_queries", "4", "--zo_eps", "5e-2",
               "--learning_rate", "2.5e-2", "--temperature", "0", "--num_generations", "1", "--prompts_per_step", "8",
               "--max_steps", str(args.steps), "--lora_r", "1", "--heldout", "1", "--seeds", "0",
               "--zo_member_batch", str(batch)]
    subprocess.run(command, check=True, capture_output=True)
    folder = out / "grpo-zo-lr0.025-seed0"
    rows = [r for line in (folder / "metrics.jsonl").open() if "loss" in (r := json.loads(line))]
    elapsed = [0.0] + [r["elapsed_s"] for r in rows]
    results = json.loads((folder / "results.json").read_text())
    return {"batch": batch, "run": number, "step_s": [b - a for a, b in itertools.pairwise(elapsed)][1:],
            "rewards": [r["reward"] for r in rows], "peak_memory_mb": results["peak_memory_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-es-member-batch")
    parser.add_argument("--member_batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = [run_once(args, batch, number) for number in range(args.runs) for batch in (1, args.member_batch)]
    with (Path(args.out) / "rows.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    one, batched = ([r for r in rows if r["batch"] == b] for b in (1, args.member_batch))
    if any(a["rewards"] != b["rewards"] for a, b in zip(one, batched, strict=True)):
        raise SystemExit("the two settings drew different answers: the comparison does not hold")
    means = [statistics.fmean(s for r in side for s in r["step_s"]) for side in (one, batched)]
    for name, side, mean in (("1", one, means[0]), (str(args.member_batch), batched, means[1])):
        steps = ", ".join(f"{s:.1f}" for r in side for s in r["step_s"])
        print(f"members per generation {name}: {mean:.2f} s/step ({steps}); peak "
              f"{max(r['peak_memory_mb'] for r in side):,.0f} MiB")
    print(f"speed-up {means[0] / means[1]:.2f}x")


if __name__ == "__main__":
    main()
