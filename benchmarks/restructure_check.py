"""Does a change cost speed? `xgblora bench`'s ratios on tiny-opt for two revisions of this repository, run in turn
(before, after, before, after, ...) so that the machine's load falls on both alike, printed side by side.

    python benchmarks/restructure_check.py BEFORE [AFTER] [--runs 5] [--data_dir ../shared/data] [--out DIR] \
        [-- MORE FLAGS FOR xgblora bench]

BEFORE and AFTER are git revisions of the repository this script sits in; AFTER defaults to `.`, the working tree
as it is (uncommitted changes included). Each revision runs from its own copy of src/ (`git archive`), with this
Python and its installed packages, and the script checks that each run imported its own copy. Every figure is a
ratio of two workloads timed side by side within one run, so it compares across runs and revisions; a difference
inside the spread of either side's runs is noise, not a slowdown. `--out` keeps each run's JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKING_TREE = "."

# The ratios compared: the bench's JSON key -> (label, which way is better).
RATIOS: dict[str, tuple[str, str]] = {
    "zo_step_over_two_forwards": ("MeZO LoRA step / two forwards", "lower"),
    "zo_full_step_over_two_forwards": ("MeZO full step / two forwards", "lower"),
    "fo_lora_speedup_vs_hf_peft": ("AdamW LoRA speed-up vs HF Trainer + PEFT", "higher"),
    "eval_speedup_vs_per_candidate": ("eval speed-up vs one pair per forward", "higher"),
}


def source_tree(revision: str, dest: Path) -> Path:
    """The src/ folder of a revision: the working tree's own for `.`, else a copy extracted from `git archive`."""
    if revision == WORKING_TREE:
        return REPO / "src"
    archive = dest / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", revision, "src"], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest / "src"


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}


def check_imports_from(src: Path) -> None:
    """Stop unless `import xgblora` under this environment finds the copy in src (not an installed one)."""
    found = subprocess.run([sys.executable, "-c", "import xgblora; print(xgblora.__file__)"], env=_env(src),
                           capture_output=True, text=True, check=True).stdout.strip()
    if Path(found).resolve() != (src / "xgblora" / "__init__.py").resolve():
        raise SystemExit(f"with PYTHONPATH={src}, `import xgblora` finds {found}: uninstall that copy or run from a "
                         "clean environment")


def bench_command(json_path: Path, data_dir: str | None, extra: list[str]) -> list[str]:
    """The bench run each revision repeats: tiny-opt's train suite without the memory figures."""
    command = [sys.executable, "-m", "xgblora.cli", "bench", "--model_name", "tiny-opt", "--skip_memory",
               "--json", str(json_path)]
    if data_dir:
        command += ["--data_dir", data_dir, "--eval_task", "RTE"]
    return command + extra


def bench(command: list[str], src: Path) -> None:
    """One bench run from src; on failure, stop with the end of its error output."""
    proc = subprocess.run(command, env=_env(src), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"`{shlex.join(command)}` from {src} exited {proc.returncode}:\n{proc.stderr[-2000:]}")


def ratios(figures: dict) -> dict[str, float]:
    """The compared ratios of one run's JSON (NaN where that revision's bench did not report one)."""
    return {key: float(figures[key]) if isinstance(figures.get(key), int | float) else math.nan for key in RATIOS}


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def table(names: tuple[str, str], before: list[dict[str, float]], after: list[dict[str, float]]) -> str:
    """A Markdown table: each ratio's runs for both revisions, their means, and after / before."""
    lines = [f"| ratio (better: lower / higher) | {names[0]}: runs | {names[1]}: runs | mean {names[0]} / "
             f"{names[1]} | {names[1]} / {names[0]} |", "|---|---|---|---|---|"]
    for key, (label, better) in RATIOS.items():
        runs = [", ".join(f"{r[key]:.3f}" for r in side) for side in (before, after)]
        mean_before, mean_after = _mean([r[key] for r in before]), _mean([r[key] for r in after])
        lines.append(f"| {label} ({better}) | {runs[0]} | {runs[1]} | {mean_before:.3f} / {mean_after:.3f} | "
                     f"{mean_after / mean_before:.3f} |")
    return "\n".join(lines)


def split_bench_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's arguments, and those after `--`, which go to xgblora bench."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def machine_line(figures: dict) -> str:
    """Where the runs ran: the CPU's model name where Linux gives it, else the bench's device name; the versions."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if line.startswith("model name")]
    device = models[0] if models and figures.get("device") == "cpu" else figures.get("device_name", "?")
    versions = figures.get("versions", {})
    return (f"{device}, {figures.get('cpu_threads', '?')} threads, torch "
            f"{versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}, {figures.get('date', '?')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="git revision measured first in each round")
    parser.add_argument("after", nargs="?", default=WORKING_TREE, help="git revision, or . for the working tree")
    parser.add_argument("--runs", type=int, default=5, help="rounds of (before, after)")
    parser.add_argument("--data_dir", default=None, help="GLUE folder: RTE dev rows for the evaluation workload")
    parser.add_argument("--out", default=None, help="folder that keeps each run's JSON (default: a temporary one)")
    argv, extra = split_bench_flags(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="restructure-check-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        sides = (args.before, args.after)
        trees = [source_tree(rev, Path(tempfile.mkdtemp(dir=tmp))) for rev in sides]
        for src in trees:
            check_imports_from(src)
        results: list[list[dict]] = [[], []]
        for run in range(1, args.runs + 1):
            for i, (rev, src) in enumerate(zip(sides, trees, strict=True)):
                path = out / f"{'before' if i == 0 else 'after'}-{run}.json"
                print(f"run {run}/{args.runs}: {rev}", file=sys.stderr, flush=True)
                bench(bench_command(path, args.data_dir, extra), src)
                results[i].append(json.loads(path.read_text()))
        print(machine_line(results[1][-1]))
        print(table(sides, *([ratios(f) for f in side] for side in results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
