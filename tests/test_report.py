"""Comparison report: numbers over seeds, the loss figure, self-contained HTML, Markdown, terminal summary."""

import json
import math
import random
import re
import statistics

import pytest
import yaml

from xgblora.errors import UserError
from xgblora.report import read_run_summary, summary_line, write_report

METHODS = (("xgblora", "zo"), ("lora", "zo"))
SEEDS = (0, 1)


def _fake_run(folder, method, trainer, seed, steps=600, merge_every=100, eval_every=100):
    """A finished run's folder with consistent config.yaml, results.json and metrics.jsonl."""
    rng = random.Random(f"{method}-{seed}")
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": method, "trainer": trainer, "task_name": "SST2",
                                                        "model_name": "facebook/opt-125m", "seed": seed}))
    floor = 0.35 if method == "xgblora" else 0.42
    lines, dev = [], 0.5
    for step in range(10, steps + 1, 10):
        loss = floor + 0.4 * math.exp(-step / 200) + rng.gauss(0, 0.04)
        lines.append({"step": step, "loss": loss, "lr": 1e-5, "elapsed_s": step * 0.05})
        if method == "xgblora" and step % merge_every == 0:
            lines.append({"step": step, "event": "merge", "booster": step // merge_every, "modules": 48})
        if step % eval_every == 0:
            dev = min(0.95, dev + 0.05 + rng.uniform(0, 0.03))
            lines.append({"step": step, "eval_accuracy": dev})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    results = {"accuracy": round(0.78 + (0.03 if method == "xgblora" else 0) + rng.uniform(0, 0.02), 4),
               "dev_accuracy": dev, "trainable_params": 12288 if method == "xgblora" else 98304,
               "train_runtime_s": 1800 + rng.uniform(0, 120), "steps": steps, "steps_per_second": 0.33 + rng.uniform(0, 0.01),
               "peak_memory_mb": 1500 + rng.uniform(0, 50), "task": "SST2", "model": "facebook/opt-125m",
               "method": method, "trainer": trainer, "seed": seed}
    (folder / "results.json").write_text(json.dumps(results))
    return results


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    results = {(m, s): _fake_run(root / f"{m}-{t}-seed{s}", m, t, s) for m, t in METHODS for s in SEEDS}
    runs = [read_run_summary(root / f"{m}-{t}-seed{s}") for m, t in METHODS for s in SEEDS]
    figure = root / "figures" / "loss_custom.png"
    return root, results, write_report(runs, root / "report", loss_figure_path=figure), figure


def test_table_numbers_are_mean_and_std_over_seeds(report):
    _, results, out, _ = report
    rows = {row["label"]: row for row in out["rows"]}
    assert list(rows) == ["xgblora (zo)", "lora (zo)"]
    for method, trainer in METHODS:
        row, seeds = rows[f"{method} ({trainer})"], [results[(method, s)] for s in SEEDS]
        for key in ("accuracy", "dev_accuracy"):
            values = [r[key] for r in seeds]
            prefix = "test" if key == "accuracy" else "dev"
            assert row[f"{prefix}_mean"] == pytest.approx(statistics.mean(values))
            assert row[f"{prefix}_std"] == pytest.approx(statistics.stdev(values))
        assert row["train_runtime_s"] == pytest.approx(statistics.mean(r["train_runtime_s"] for r in seeds))
        assert row["steps_per_second"] == pytest.approx(statistics.mean(r["steps_per_second"] for r in seeds))
        assert row["peak_memory_mb"] == pytest.approx(max(r["peak_memory_mb"] for r in seeds))
        assert row["trainable_params"] == seeds[0]["trainable_params"]
        assert row["seeds"] == 2 and row["metric"] == "accuracy"


def test_loss_figure_goes_to_the_given_path_and_is_a_real_png(report):
    root, _, out, figure = report
    assert out["loss_figure"] == figure and not (root / "report" / "loss.png").exists()
    data = figure.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_html_is_self_contained_with_one_row_per_method(report):
    _, results, out, _ = report
    text = out["html"].read_text()
    assert "http://" not in text and "https://" not in text and 'src="file' not in text
    assert re.findall(r'src="([^"]{0,22})', text) == ["data:image/png;base64,"]
    body = text.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<tr>") == len(METHODS)
    mean = statistics.mean(results[("xgblora", s)]["accuracy"] for s in SEEDS)
    assert f"{mean:.3f}±" in body and "12,288" in body


def test_markdown_has_the_table_and_links_the_figure(report):
    _, _, out, figure = report
    text = out["markdown"].read_text()
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[0].startswith("| Method | Trainer | Trainable params | Dev accuracy | Test accuracy")
    assert len(table) == 2 + len(METHODS) and table[2].startswith("| xgblora | zo | 12,288 |")
    assert "(../figures/loss_custom.png)" in text


def test_summary_line(report):
    _, results, out, _ = report
    line = summary_line(out["rows"])
    x = [results[("xgblora", s)]["accuracy"] for s in SEEDS]
    assert line.startswith(f"SST2: xgblora (zo) {statistics.mean(x):.3f}±{statistics.stdev(x):.3f} | lora (zo) ")
    assert line.endswith("(accuracy, 2 seeds)") and "\n" not in line


def test_one_seed_omits_std_and_default_figure_path(tmp_path):
    result = _fake_run(tmp_path / "run", "lora", "regular", 0)
    out = write_report([read_run_summary(tmp_path / "run")], tmp_path / "out", smoothing=0.0)
    assert out["loss_figure"] == tmp_path / "out" / "loss.png" and out["loss_figure"].is_file()
    assert summary_line(out["rows"]) == f"SST2: lora (regular) {result['accuracy']:.3f} (accuracy, 1 seed)"
    assert out["rows"][0]["test_std"] is None


def test_load_run_tolerates_missing_optional_files_and_keys(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"f1": 0.61, "task": "SQuAD", "model": "m", "method": "lora",
                                                     "trainer": "zo", "seed": 3}))
    run = read_run_summary(folder)
    assert (run.task, run.method, run.seed, run.metrics) == ("SQuAD", "lora", 3, [])
    out = write_report([run], tmp_path / "out")
    row = out["rows"][0]
    assert row["metric"] == "f1" and row["test_mean"] == 0.61 and row["dev_mean"] is None
    assert "| lora | zo | – | – | 0.610 | – | – | – | 1 |" in out["markdown"].read_text()


def test_load_run_without_results_is_a_user_error(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match="no results.json"):
        read_run_summary(tmp_path / "run")


def test_a_run_with_one_logged_loss_is_drawn_as_a_point(tmp_path, monkeypatch):
    """A short run logs one loss: a line through one point draws nothing, so the point gets a marker."""
    from matplotlib.figure import Figure

    from xgblora.report import plot_losses

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    _fake_run(tmp_path / "run", "lora", "regular", 0, steps=10)
    plot_losses([read_run_summary(tmp_path / "run")], tmp_path / "loss.png", smoothing=0.0)
    (line,) = [ln for ln in figures[0].axes[0].lines if len(ln.get_xdata()) == 1]
    assert list(line.get_xdata()) == [10] and line.get_marker() == "o"
