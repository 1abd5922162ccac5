"""DPO on a real model: SmolLM2-135M-Instruct on two-digit addition, from its own answers, held-out greedy accuracy
before and after.

The task and questions are `benchmarks/rft_smollm2.py`'s ("What is a + b? Reply with the number only.", a, b in
10..99, seeded disjoint training and held-out questions; an answer is the reply's last number). The model samples
--samples answers per training question at temperature 0.7 (`xgblora generate`); a question with a correct and a
wrong answer gives a pair (chosen: a correct one, rejected: a wrong one, as conversational rows through the chat
template). `xgblora dpo` trains LoRA r=8 on q/v on the pairs; greedy accuracy on the held-out questions is measured
before and after (`xgblora generate` with the trained adapter). A row is appended to OUT/table.md as each run lands.

    python benchmarks/dpo_smollm2.py --out bench-dpo --trainer regular --seeds 0 1 2
    python benchmarks/dpo_smollm2.py --out bench-dpo --trainer zo --learning_rate 1e-4 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from rft_smollm2 import prepare, write_questions

from xgblora.config import DPOConfig, GenerateConfig
from xgblora.generation.generate import generate_file
from xgblora.recipes.dpo import run_dpo

NUMBER = re.compile(r"-?\d[\d,]*")


def answer_of(reply: str) -> str | None:
    """The reply's last number (commas dropped), or None."""
    found = NUMBER.findall(reply)
    return found[-1].replace(",", "") if found else None


def sampled(model: str, questions: Path, output: Path, samples: int, seed: int, device: str,
            adapter: str | None = None) -> list[dict]:
    """Each question's row with its completions: `samples` at temperature 0.7, or one greedy (samples 1); a file
    already written is read again."""
    if not output.exists():
        generate_file(GenerateConfig(model_name=model, adapter=adapter, input_file=str(questions),
                                     output_file=str(output), columns="prompt=question",
                                     num_return_sequences=samples, temperature=0.7 if samples > 1 else 0.0,
                                     max_new_tokens=16, seed=seed, device=device))
    return [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]


def accuracy(rows: list[dict]) -> float:
    """The share of rows whose first completion's answer is the sum."""
    return sum(answer_of(r["completions"][0]) == r["answer"] for r in rows) / len(rows)


def write_pairs(rows: list[dict], path: Path, seed: int) -> int:
    """A pair per question with a correct and a wrong sample (one of each, drawn at random); returns the count."""
    rng = random.Random(seed)
    lines = []
    for r in rows:
        right = sorted({c for c in r["completions"] if answer_of(c) == r["answer"]})
        wrong = sorted({c for c in r["completions"] if answer_of(c) != r["answer"] and c.strip()})
        if right and wrong:
            lines.append({"prompt": [{"role": "user", "content": r["question"]}],
                          "chosen": [{"role": "assistant", "content": rng.choice(right)}],
                          "rejected": [{"role": "assistant", "content": rng.choice(wrong)}]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-dpo-smollm2")
    parser.add_argument("--trainer", choices=("regular", "zo"), default="regular")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    out = Path(args.out)
    model, table = prepare(out, "| seed | trainer | lr | pairs | steps | greedy acc before | greedy acc after | "
                                "train loss | train s |")
    for seed in args.seeds:
        train_file, heldout = write_questions(out, args.questions, args.heldout, seed)
        rows = sampled(model, train_file, out / f"samples-seed{seed}.jsonl", args.samples, seed, args.device)
        pairs = write_pairs(rows, out / f"pairs-seed{seed}.jsonl", seed)
        before = accuracy(sampled(model, heldout, out / f"greedy-base-seed{seed}.jsonl", 1, seed, args.device))
        name = f"dpo-{args.trainer}-lr{args.learning_rate:g}-seed{seed}"
        done = run_dpo(DPOConfig(model_name=model, task_name="custom", train_file=str(out / f"pairs-seed{seed}.jsonl"),
                                 method="lora", trainer=args.trainer, learning_rate=args.learning_rate,
                                 beta=args.beta, per_device_train_batch_size=8, max_steps=args.max_steps,
                                 save_strategy="no", logging_steps=5, seed=seed, device=args.device,
                                 output_dir=str(out / name)))
        after = accuracy(sampled(model, heldout, out / f"greedy-{name}.jsonl", 1, seed, args.device,
                                 adapter=str(out / name)))
        row = (f"| {seed} | {args.trainer} | {args.learning_rate:g} | {pairs} | {done['steps']} | {before:.3f} | "
               f"{after:.3f} | {done.get('train_loss', float('nan')):.4f} | {done['train_runtime_s']:.0f} |\n")
        print(json.dumps(done), flush=True)
        with table.open("a", encoding="utf-8") as f:
            f.write(row)


if __name__ == "__main__":
    main()
