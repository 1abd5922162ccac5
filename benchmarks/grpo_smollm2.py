"""GRPO on a real model: SmolLM2-135M-Instruct on two-digit addition, held-out greedy pass@1 before and after,
on the task, questions and sampling of `benchmarks/rft_smollm2.py` (so the two compare at an equal sample budget).

"What is a + b? Reply with the number only." (a, b in 10..99; the same seeded training and held-out questions as
the RFT benchmark), the reward 1 when the reply's last number is the sum (`regex:`, the RFT verifier), G = 8
completions of at most 32 tokens at temperature 0.7, LoRA r=8 on q/v, loss dapo, beta 0, 4 prompts a step: 50 steps
sample 1,600 completions, one RFT round's worth. A row is appended to OUT/table.md as each run lands.

    python benchmarks/grpo_smollm2.py --out bench-grpo --trainer regular --seeds 0 1 2
    python benchmarks/grpo_smollm2.py --out bench-grpo --trainer zo --learning_rate 1e-4 --seeds 0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rft_smollm2 import LAST_NUMBER, prepare, write_questions

from xgblora.config import GRPOConfig
from xgblora.generation.grpo import run_grpo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-grpo-smollm2")
    parser.add_argument("--trainer", choices=("regular", "zo"), default="regular")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--max_steps", type=int, default=50)
    parser.add_argument("--prompts_per_step", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    out = Path(args.out)
    model, table = prepare(out, "| seed | trainer | lr | steps | pass@1 before | pass@1 after | train s |")
    for seed in args.seeds:
        train_file, heldout = write_questions(out, args.questions, args.heldout, seed)
        cfg = GRPOConfig(model_name=model, train_file=str(train_file), eval_file=str(heldout),
                         columns="prompt=question,completion=answer", reward_funcs=[LAST_NUMBER], raw_prompts=False,
                         num_return_sequences=8, temperature=0.7, max_new_tokens=args.max_new_tokens,
                         per_device_train_batch_size=8 * args.prompts_per_step, max_steps=args.max_steps,
                         method="lora", trainer=args.trainer, learning_rate=args.learning_rate, save_strategy="no",
                         logging_steps=5, seed=seed, device=args.device,
                         output_dir=str(out / f"grpo-{args.trainer}-lr{args.learning_rate:g}-seed{seed}"))
        done = run_grpo(cfg)
        row = (f"| {seed} | {args.trainer} | {args.learning_rate:g} | {done['steps']} | "
               f"{done['before_eval_pass@1']:.3f} | {done['eval_pass@1']:.3f} | {done['train_runtime_s']:.0f} |\n")
        print(json.dumps(done), flush=True)
        with table.open("a", encoding="utf-8") as f:
            f.write(row)


if __name__ == "__main__":
    main()
