"""Held-out greedy accuracy before and after GRPO on the synthetic arithmetic task of the RFT tests.

"Which is larger, a or b?" with answers in GSM8K's format (`#### n`): tiny-llama is fine-tuned on 15 questions
(full fine-tuning, AdamW, 60 steps; what tests/test_rft.py and tests/test_grpo.py start from), merged, then trained
with `xgblora grpo` on 60 questions (G = 8, two prompts a step, the gsm8k correctness reward, loss dapo, beta 0)
and measured on the 30 held-out ones, greedy. Prints one JSON line.

    python benchmarks/grpo_learning.py --trainer regular --learning_rate 1e-3 --max_steps 30
    python benchmarks/grpo_learning.py --trainer zo --learning_rate 1e-3 --max_steps 30
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from xgblora.config import Config, GRPOConfig
from xgblora.export import export_run
from xgblora.recipes.grpo import run_grpo
from xgblora.recipes.sft import run


def write_questions(path: Path, pairs: list[tuple[int, int]]) -> None:
    rows = [{"question": f"Which is larger, {a} or {b}?", "answer": f"#### {max(a, b)}"} for a, b in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("regular", "zo"), default="regular")
    parser.add_argument("--method", choices=("ft", "lora", "xgblora"), default="ft")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="xgblora-grpo-learning-"))
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)
    write_questions(root / "sft.jsonl", pairs[:15])
    write_questions(root / "questions.jsonl", pairs[:60])
    write_questions(root / "heldout.jsonl", pairs[60:])
    common = dict(task_name="custom", eval_file=str(root / "heldout.jsonl"), save_strategy="no", max_new_tokens=6,
                  columns="prompt=question,completion=answer", device="cpu", seed=args.seed)
    run(Config(model_name="tiny-llama", train_file=str(root / "sft.jsonl"), output_dir=str(root / "sft"), method="ft",
               per_device_train_batch_size=16, learning_rate=3e-3, max_steps=60, no_eval=True, **common))
    export_run(root / "sft", "merged", root / "sft-merged")
    done = run_grpo(GRPOConfig(model_name=str(root / "sft-merged"), train_file=str(root / "questions.jsonl"),
                               output_dir=str(root / "grpo"), method=args.method, trainer=args.trainer,
                               learning_rate=args.learning_rate, max_steps=args.max_steps,
                               per_device_train_batch_size=16, num_return_sequences=8, logging_steps=5, **common))
    print(json.dumps({**vars(args), "before": done["before_eval_pass@1"], "after": done["eval_pass@1"],
                      "run": str(root / "grpo")}))


if __name__ == "__main__":
    main()
