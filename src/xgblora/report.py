"""Comparison report of finished runs: the loss figure, and tables over seeds as Markdown and self-contained HTML."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from xgblora import atomic
from xgblora.errors import UserError
from xgblora.logs import read_metrics

METRICS = ("accuracy", "f1")  # the test metric of a run is the first of these in its results.json
MANY_MERGES = 30  # above this many merges the loss panel marks them with ticks only, no lines
COLUMNS = ("Method", "Trainer", "Trainable params", "Dev {m}", "Test {m}", "Wall time", "Steps/s", "Peak memory (MB)", "Seeds")


@dataclass
class RunSummary:
    """One finished run, read from its folder: what ran, its results.json and its metrics.jsonl."""

    run_dir: Path
    method: str
    trainer: str
    task: str
    model: str
    seed: int
    results: dict
    metrics: list[dict]

    @property
    def label(self) -> str:
        """The run's method label in tables and legends, e.g. "xgblora (zo)"."""
        return f"{self.method} ({self.trainer})"


def trainer_label(trainer: str, zo_estimator: str = "mezo", zo_optimizer: str = "sgd") -> str:
    """The trainer as run labels say it: regular, zo (MeZO-SGD), or zo:ESTIMATOR[+OPTIMIZER] (zo:fzoo, zo:mezo+adam)."""
    if trainer != "zo" or (zo_estimator, zo_optimizer) == ("mezo", "sgd"):
        return trainer
    return f"zo:{zo_estimator}" + ("" if zo_optimizer == "sgd" else f"+{zo_optimizer}")


def _read_mapping(path: Path, loader: Any) -> dict:
    """A JSON or YAML file holding a mapping; UserError when it is unreadable or not a mapping."""
    try:
        data = loader(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot read ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def read_run_summary(run_dir: Path) -> RunSummary:
    """Read a finished run's folder: config.yaml (what ran), results.json (final metrics), metrics.jsonl (curves)."""
    run_dir = Path(run_dir)
    if not (run_dir / "results.json").is_file():
        raise UserError(f"{run_dir}: no results.json (the run has not finished)")
    results = _read_mapping(run_dir / "results.json", json.loads)
    config = _read_mapping(run_dir / "config.yaml", yaml.safe_load) if (run_dir / "config.yaml").is_file() else {}

    def pick(config_key: str, results_key: str, default: Any) -> Any:
        return config.get(config_key, results.get(results_key, default))

    metrics_path = run_dir / "metrics.jsonl"
    return RunSummary(run_dir=run_dir, method=str(pick("method", "method", "?")), trainer=trainer_label(str(pick("trainer", "trainer", "?")), config.get("zo_estimator", "mezo"),
                                                 config.get("zo_optimizer", "sgd")),
                      task=str(pick("task_name", "task", "?")), model=str(pick("model_name", "model", "?")),
                      seed=int(pick("seed", "seed", 0)), results=results,
                      metrics=read_metrics(metrics_path) if metrics_path.is_file() else [])


# ----------------------------------------------------------------------------- numbers

def _metric_name(runs: Sequence[RunSummary]) -> str:
    """The test metric the runs report (accuracy for classification, f1 for generation)."""
    for run in runs:
        for name in METRICS:
            if isinstance(run.results.get(name), (int, float)):
                return name
    return METRICS[0]


def _dev_value(run: RunSummary, metric: str) -> float | None:
    """The run's final dev metric: results.json's dev_<metric>, else the last eval_<metric> in metrics.jsonl."""
    if isinstance(run.results.get(f"dev_{metric}"), (int, float)):
        return float(run.results[f"dev_{metric}"])
    evals = [r[f"eval_{metric}"] for r in run.metrics if isinstance(r.get(f"eval_{metric}"), (int, float))]
    return float(evals[-1]) if evals else None


def _numbers(runs: Sequence[RunSummary], key: str) -> list[float]:
    """The finite numeric values of results[key] over the runs (missing ones left out)."""
    values = [run.results.get(key) for run in runs]
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None with fewer than two values) of the values present."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None


def _groups(runs: Sequence[RunSummary]) -> dict[tuple[str, str], dict[str, list[RunSummary]]]:
    """Runs grouped by (task, model), then by method label, in order of first appearance; seeds sorted."""
    groups: dict[tuple[str, str], dict[str, list[RunSummary]]] = {}
    for run in runs:
        groups.setdefault((run.task, run.model), {}).setdefault(run.label, []).append(run)
    for by_label in groups.values():
        for seeds in by_label.values():
            seeds.sort(key=lambda r: r.seed)
    return groups


def _row(task: str, model: str, label: str, seeds: list[RunSummary], metric: str) -> dict[str, Any]:
    """One table row: a method over its seeds."""
    test_mean, test_std = _mean_std([float(r.results[metric]) if isinstance(r.results.get(metric), (int, float)) else None
                                     for r in seeds])
    dev_mean, dev_std = _mean_std([_dev_value(r, metric) for r in seeds])
    params = sorted({int(v) for v in _numbers(seeds, "trainable_params")})
    runtime, speed, memory = (_numbers(seeds, k) for k in ("train_runtime_s", "steps_per_second", "peak_memory_mb"))
    return {
        "task": task, "model": model, "label": label, "method": seeds[0].method, "trainer": seeds[0].trainer,
        "metric": metric, "seeds": len(seeds),
        "trainable_params": params[0] if len(params) == 1 else (params or None),
        "dev_mean": dev_mean, "dev_std": dev_std, "test_mean": test_mean, "test_std": test_std,
        "train_runtime_s": statistics.fmean(runtime) if runtime else None,
        "steps_per_second": statistics.fmean(speed) if speed else None,
        "peak_memory_mb": max(memory) if memory else None,
    }


# ----------------------------------------------------------------------------- formatting

def _fmt_metric(mean: float | None, std: float | None) -> str:
    """0.812±0.010, or 0.812 with one seed, or – when missing."""
    if mean is None:
        return "–"
    return f"{mean:.3f}" + (f"±{std:.3f}" if std is not None else "")


def _fmt_params(value: int | list[int] | None) -> str:
    """Trainable parameters with thousands separators (a range when seeds differ)."""
    if value is None:
        return "–"
    if isinstance(value, list):
        return f"{value[0]:,}–{value[-1]:,}"
    return f"{value:,}"


def _fmt_duration(seconds: float | None) -> str:
    """12.3 s, 4m 05s, 1h 02m."""
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def _cells(row: dict[str, Any]) -> list[str]:
    """The table cells of a row, in COLUMNS order."""
    speed, memory = row["steps_per_second"], row["peak_memory_mb"]
    return [row["method"], row["trainer"], _fmt_params(row["trainable_params"]),
            _fmt_metric(row["dev_mean"], row["dev_std"]), _fmt_metric(row["test_mean"], row["test_std"]),
            _fmt_duration(row["train_runtime_s"]), "–" if speed is None else f"{speed:.3g}",
            "–" if memory is None else f"{memory:,.0f}", str(row["seeds"])]


def _headers(metric: str) -> list[str]:
    """Column headings with the metric's name filled in."""
    return [c.format(m=metric) for c in COLUMNS]


def summary_line(rows: Sequence[dict[str, Any]]) -> str:
    """One terminal line per task: "SST2: xgblora (zo) 0.812±0.010 | lora (zo) 0.795±0.012 (accuracy, 3 seeds)"."""
    lines = []
    for key in dict.fromkeys((r["task"], r["model"]) for r in rows):
        group = [r for r in rows if (r["task"], r["model"]) == key]
        seeds = sorted({r["seeds"] for r in group})
        count = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]}"
        methods = " | ".join(f"{r['label']} {_fmt_metric(r['test_mean'], r['test_std'])}" for r in group)
        lines.append(f"{key[0]}: {methods} ({group[0]['metric']}, {count} seed{'s' if seeds[-1] != 1 else ''})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- figure

def _ema(values: Sequence[float], smoothing: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing); non-finite values are carried over."""
    out, avg, weight = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            avg = smoothing * avg + (1 - smoothing) * value
            weight = smoothing * weight + (1 - smoothing)
        out.append(avg / weight if weight else math.nan)
    return out


def _series(runs: Sequence[RunSummary], key: str, smoothing: float) -> tuple[Any, Any, Any, Any] | None:
    """(steps, mean, low, high) of metrics[key] over runs on a shared step grid (their overlap); None when absent."""
    import numpy as np

    curves = []
    for run in runs:
        points = sorted({int(r["step"]): float(r[key]) for r in run.metrics
                         if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), (int, float))}.items())
        if points:
            steps, values = zip(*points, strict=True)
            curves.append((np.asarray(steps, float), np.asarray(_ema(values, smoothing) if smoothing else values)))
    if not curves:
        return None
    lo_step, hi_step = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
    grid = np.unique(np.concatenate([c[0] for c in curves]))
    grid = grid[(grid >= lo_step) & (grid <= hi_step)] if lo_step <= hi_step else curves[0][0]
    stack = np.stack([np.interp(grid, s, v) for s, v in curves])
    return grid, stack.mean(axis=0), stack.min(axis=0), stack.max(axis=0)


def _merge_steps(runs: Sequence[RunSummary]) -> list[int]:
    """Steps at which any of the runs merged a booster."""
    return sorted({int(r["step"]) for run in runs for r in run.metrics if r.get("event") == "merge" and "step" in r})


def _eval_keys(runs: Sequence[RunSummary]) -> list[str]:
    """The dev curves to plot: eval_accuracy / eval_f1 when logged, else every eval_* key (one scale per panel)."""
    keys = {k for run in runs for r in run.metrics for k in r if k.startswith("eval_")}
    return [f"eval_{m}" for m in METRICS if f"eval_{m}" in keys] or sorted(keys)


def plot_losses(runs: Sequence[RunSummary], path: Path, smoothing: float = 0.9) -> Path:
    """Write the loss figure: per (task, model) a smoothed training-loss panel (mean over seeds, min–max band,
    booster merges marked) and, when evaluated, a dev-metric panel; returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = _groups(runs)
    labels = list(dict.fromkeys(run.label for run in runs))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    eval_keys = {key: _eval_keys(sum(g.values(), [])) for key, g in groups.items()}
    columns = 2 if any(eval_keys.values()) else 1
    fig = Figure(figsize=(6.4 * columns, 4.4 * len(groups)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), columns, squeeze=False)
    for (task, model), row_axes in zip(groups, axes, strict=True):
        where = f"{task} · {model}: " if len(groups) > 1 else ""
        _plot_training_loss(row_axes[0], groups[(task, model)], colors, smoothing, where)
        if columns == 2:
            _plot_dev(row_axes[1], groups[(task, model)], eval_keys[(task, model)], colors, where)
    if len(groups) == 1:
        fig.suptitle(" · ".join(next(iter(groups))) + ": " + " vs ".join(labels), fontsize=12, fontweight="bold")
    path, png = Path(path), io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    atomic.write_bytes(path, png.getvalue())
    return path


def _plot_training_loss(ax: Any, by_label: dict[str, list[RunSummary]], colors: dict[str, str], smoothing: float,
                        where: str) -> None:
    """One panel: each label's smoothed training loss (mean over seeds, min–max band) and its booster merges."""
    handles = []
    for label, seeds in by_label.items():
        color, series = colors[label], _series(seeds, "loss", smoothing)
        if series is None:
            continue
        steps, mean, low, high = series
        name = f"{label}, mean of {len(seeds)} seeds" if len(seeds) > 1 else f"{label}, seed {seeds[0].seed}"
        dots = {"marker": "o", "ms": 4} if len(steps) < 3 else {}  # a line through one point draws nothing
        handles.append(ax.plot(steps, mean, color=color, lw=1.8, label=name, **dots)[0])
        if len(seeds) > 1:
            ax.fill_between(steps, low, high, color=color, alpha=0.18, lw=0)
        merges = _merge_steps(seeds)
        if merges:
            handles.append(_mark_merges(ax, merges, color, label))
    if handles:
        banded = any(len(seeds) > 1 for seeds in by_label.values())
        ax.legend(handles=handles, fontsize=8, title_fontsize=8, loc="upper right", framealpha=0.85,
                  title="bands: min–max over seeds" if banded else None)
    else:
        ax.text(0.5, 0.5, "no training loss logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (EMA {smoothing:g})" if smoothing else "training loss")
    ax.set_title(f"{where}training loss", fontsize=11)
    ax.grid(alpha=0.3)


def _mark_merges(ax: Any, merges: list[int], color: str, label: str) -> Any:
    """Booster merges on a loss panel (few: dotted lines and ticks at the bottom; many: the ticks alone); returns
    their legend handle."""
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    ticks = blended_transform_factory(ax.transData, ax.transAxes)
    few = len(merges) <= MANY_MERGES
    if few:
        ax.vlines(merges, 0, 1, transform=ticks, colors=color, lw=0.8, alpha=0.5, linestyles=(0, (2, 3)), zorder=0)
    marker = {"marker": "^", "ms": 5} if few else {"marker": "|", "ms": 7, "alpha": 0.6}
    ax.plot(merges, [0.0] * len(merges), transform=ticks, ls="none", color=color, clip_on=False, **marker)
    return Line2D([], [], color=color, ls=(0, (2, 3)) if few else "none", lw=0.8, **marker,
                  label=f"{label}: booster merges ({len(merges)})")


def _plot_dev(ax: Any, by_label: dict[str, list[RunSummary]], keys: list[str], colors: dict[str, str],
              where: str) -> None:
    """The dev-metric panel: each eval_* curve per method, mean over seeds with a min–max band."""
    styles = ("-", "--", ":", "-.")
    for label, seeds in by_label.items():
        for i, key in enumerate(keys):
            series = _series(seeds, key, 0.0)
            if series is None:
                continue
            steps, mean, low, high = series
            name = label if len(keys) == 1 else f"{label} {key[len('eval_'):]}"
            ax.plot(steps, mean, color=colors[label], ls=styles[i % len(styles)], marker="o", ms=3.5, lw=1.5, label=name)
            if len(seeds) > 1:
                ax.fill_between(steps, low, high, color=colors[label], alpha=0.18, lw=0)
    if ax.lines:
        ax.legend(fontsize=8, loc="lower right", framealpha=0.85)
    else:
        ax.text(0.5, 0.5, "no dev evaluation logged", ha="center", va="center", transform=ax.transAxes)
    metric = keys[0][len("eval_"):] if len(keys) == 1 else "metric"
    ax.set_xlabel("step")
    ax.set_ylabel(f"dev {metric}")
    ax.set_title(f"{where}dev {metric}", fontsize=11)
    ax.grid(alpha=0.3)


# ----------------------------------------------------------------------------- documents

def _markdown(tables: list[tuple[str, list[dict[str, Any]]]], figure: str) -> str:
    """report.md: one table per (task, model) and the loss figure."""
    parts = ["# xgblora comparison report", ""]
    for title, rows in tables:
        headers = _headers(rows[0]["metric"])
        parts += [f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        parts += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in rows]
        parts.append("")
    parts += ["Metrics: mean ± sample standard deviation over seeds; wall time and steps/s are means, "
              "peak memory the largest over seeds.", "", f"![training loss and dev metric]({figure})", ""]
    return "\n".join(parts)


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #222; padding: 0 1rem; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 1.8rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.92rem; }
th, td { padding: 0.35rem 0.75rem; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th { background: #f4f4f6; border-bottom: 2px solid #bbb; }
td:nth-child(-n+2), th:nth-child(-n+2) { text-align: left; }
tbody tr:hover { background: #fafafa; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
p.note, details { color: #555; font-size: 0.85rem; }
"""


def _html(tables: list[tuple[str, list[dict[str, Any]]]], png: bytes, run_dirs: list[str]) -> str:
    """report.html: the tables and the figure inline (base64 PNG), styles inline; no external assets."""
    esc = html.escape
    body = ["<h1>xgblora comparison report</h1>"]
    for title, rows in tables:
        head = "".join(f"<th>{esc(h)}</th>" for h in _headers(rows[0]["metric"]))
        trs = "\n".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in _cells(r)) + "</tr>" for r in rows)
        body += [f"<h2>{esc(title)}</h2>", f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{trs}\n</tbody>\n</table>"]
    body.append('<p class="note">Metrics: mean ± sample standard deviation over seeds; wall time and steps/s are means, '
                "peak memory the largest over seeds.</p>")
    image = base64.b64encode(png).decode("ascii")
    body.append(f'<img alt="training loss and dev metric" src="data:image/png;base64,{image}">')
    body.append("<details><summary>Runs</summary><ul>" + "".join(f"<li>{esc(d)}</li>" for d in run_dirs)
                + "</ul></details>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>xgblora comparison report</title>\n"
            f"<style>{_CSS}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")


def write_report(runs: list[RunSummary], out_root: Path, loss_figure_path: Path | None = None,
                 smoothing: float = 0.9) -> dict:
    """Write loss.png (or loss_figure_path), report.md and report.html under out_root; return the rows and paths."""
    if not runs:
        raise UserError(f"{out_root}: no finished runs to report on")
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    figure = plot_losses(runs, Path(loss_figure_path) if loss_figure_path else out_root / "loss.png", smoothing)
    rows, tables = [], []
    for (task, model), by_label in _groups(runs).items():
        metric = _metric_name(sum(by_label.values(), []))
        group = [_row(task, model, label, seeds, metric) for label, seeds in by_label.items()]
        rows += group
        tables.append((f"{task} · {model}", group))
    markdown_path, html_path = out_root / "report.md", out_root / "report.html"
    try:
        figure_link = Path(os.path.relpath(figure.resolve(), out_root.resolve())).as_posix()
    except ValueError:  # another drive on Windows
        figure_link = figure.resolve().as_uri()
    atomic.write_text(markdown_path, _markdown(tables, figure_link))
    run_dirs = [str(run.run_dir) for run in runs]
    atomic.write_text(html_path, _html(tables, figure.read_bytes(), run_dirs))
    return {"rows": rows, "loss_figure": figure, "markdown": markdown_path, "html": html_path}


def write_rft_report(records: Sequence[dict[str, Any]], out_root: Path) -> dict[str, Path]:
    """rft.png (held-out pass@1 / pass@k and the kept fraction per round) and report.html with the round table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [k for k in records[0] if k.startswith("pass@")]
    rounds = [r["round"] for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in metrics:
        left.plot(rounds, [r[name] for r in records], marker="o", label=name)
    left.set(xlabel="round", ylabel="held-out accuracy", title="accuracy per round", xticks=rounds)
    left.legend()
    trained = [r for r in records if "kept_fraction" in r]
    right.bar([r["round"] for r in trained], [r["kept_fraction"] for r in trained], color="#4c72b0")
    right.set(xlabel="round", ylabel="kept / sampled", title="kept fraction per round", xticks=rounds)
    fig.tight_layout()
    figure = Path(out_root) / "rft.png"
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    columns = ["round", *metrics, "samples", "truncated", "correct", "kept", "train_rows", "kept_fraction",
               "questions_solved"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    cells = ["".join(f"<td>{_fmt_cell(r.get(c))}</td>" for c in columns) for r in records]
    image = base64.b64encode(figure.read_bytes()).decode("ascii")
    page = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>xgblora RFT report</title>\n"
            f"<style>{_CSS}</style>\n</head>\n<body>\n<h1>xgblora RFT report</h1>\n<table>\n<thead><tr>{head}</tr>"
            "</thead>\n<tbody>\n" + "\n".join(f"<tr>{c}</tr>" for c in cells) + "\n</tbody>\n</table>\n"
            f'<img alt="accuracy and kept fraction per round" src="data:image/png;base64,{image}">\n</body>\n</html>\n')
    atomic.write_text(Path(out_root) / "report.html", page)
    return {"figure": figure, "html": Path(out_root) / "report.html"}


# The curves of a run's report.html, per command: (logged key, panel title).
GRPO_PANELS = (("reward", "reward (total)"), ("accuracy", "accuracy (training samples)"),
               ("completion_length", "completion length (tokens)"), ("kl", "KL to the reference"),
               ("clip_ratio", "clipped fraction of tokens"), ("entropy", "entropy (nats per token)"))
DPO_PANELS = (("loss", "loss"), ("rewards/accuracies", "preference accuracy (chosen > rejected)"),
              ("rewards/margins", "reward margin"), ("rewards/chosen", "reward of chosen"),
              ("rewards/rejected", "reward of rejected"))
KTO_PANELS = (("loss", "loss"), ("rewards/margins", "reward margin (desirable - undesirable)"),
              ("rewards/chosen", "reward of desirable rows"), ("rewards/rejected", "reward of undesirable rows"),
              ("kl", "KL estimate"))
REWARD_PANELS = (("loss", "loss"), ("accuracy", "preference accuracy (chosen > rejected)"),
                 ("margin", "reward margin (chosen - rejected)"), ("mean_reward", "mean reward"))


def write_curves_report(run_dir: Path, results: dict[str, Any], name: str,
                        panels: Sequence[tuple[str, str]]) -> dict[str, Path]:
    """NAME.png (the panels' metrics per logged training step) and report.html with the run's results, from the
    run's metrics.jsonl (grpo: GRPO_PANELS, dpo: DPO_PANELS, kto: KTO_PANELS, reward: REWARD_PANELS)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r]
    shown_panels = [(key, title) for key, title in panels if any(key in r for r in records)]
    fig, axes = plt.subplots(1, max(len(shown_panels), 1), figsize=(3.2 * max(len(shown_panels), 1), 3.2),
                             squeeze=False)
    for ax, (key, title) in zip(axes[0], shown_panels, strict=False):
        shown = [r for r in records if r.get(key) is not None]
        ax.plot([r["step"] for r in shown], [r[key] for r in shown], color="#4c72b0")
        ax.set(xlabel="step", title=title)
    fig.tight_layout()
    figure = Path(run_dir) / f"{name}.png"
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{_fmt_cell(v)}</td></tr>" for k, v in results.items())
    image = base64.b64encode(figure.read_bytes()).decode("ascii")
    title = f"xgblora {name.upper()} report"
    page = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<h1>{title}</h1>\n"
            f'<img alt="{name} training curves" src="data:image/png;base64,{image}">\n'
            f"<table>\n<tbody>\n{rows}\n</tbody>\n</table>\n</body>\n</html>\n")
    atomic.write_text(Path(run_dir) / "report.html", page)
    return {"figure": figure, "html": Path(run_dir) / "report.html"}


def _fmt_cell(value: Any) -> str:
    return "" if value is None else f"{value:.3f}" if isinstance(value, float) else html.escape(str(value))


def _figure_table(first: str, figures: dict[str, dict[str, float]]) -> str:
    """An HTML table of figures: one row per label, one column per figure name."""
    names = list(next(iter(figures.values())))
    head = "".join(f"<th>{html.escape(n)}</th>" for n in (first, *names))
    rows = "".join(f"<tr><td>{html.escape(label)}</td>" + "".join(f"<td>{values[n]:.4f}</td>" for n in names)
                   + "</tr>\n" for label, values in figures.items())
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}</tbody>\n</table>\n"


def write_retrieval_report(run_dir: Path, results: dict[str, Any], figures: dict[str, dict[str, float]],
                           reranking: dict[str, dict[str, float]] | None = None) -> Path:
    """report.html of a retrieval evaluation: what was scored (the results' other entries), then the figures, one
    row per embedding size (`figures`: size label -> figure name -> value), and a reranker's figures before and
    after (`reranking`: row label -> figure name -> value)."""
    about = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{_fmt_cell(v)}</td></tr>" for k, v in results.items()
                    if not isinstance(v, float))
    reranked = ("<h2>Reranking</h2>\n" + _figure_table("ranking", reranking) +
                '<p class="note">As sentence-transformers\' CrossEncoderRerankingEvaluator: the mean over the queries '
                "of MAP, MRR@10 and nDCG@10 of the first stage's top k and of the reranker's order of them.</p>\n"
                ) if reranking else ""
    page = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>xgblora retrieval report</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            f"<h1>xgblora retrieval report</h1>\n<table>\n<tbody>\n{about}</tbody>\n</table>\n"
            f"<h2>Cosine similarity</h2>\n{_figure_table('embedding', figures)}"
            '<p class="note">As sentence-transformers\' InformationRetrievalEvaluator: each figure is the mean over '
            f"the queries that have a relevant document; ties go to the smaller document id.</p>\n{reranked}"
            "</body>\n</html>\n")
    path = Path(run_dir) / "report.html"
    atomic.write_text(path, page)
    return path
