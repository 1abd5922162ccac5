"""The offline demo: generated data, all four runs at the demo's own length, and a clear margin over the untrained
model."""

import json

import pytest

from xgblora.demo import sentiment_rows


def test_generated_task_is_seeded_and_balanced():
    rows = sentiment_rows(400, seed=3)
    assert rows == sentiment_rows(400, seed=3) and rows != sentiment_rows(400, seed=4)
    assert 150 < sum(r["label"] for r in rows) < 250


@pytest.mark.slow
def test_demo_beats_untrained_model(tmp_path):
    from xgblora.demo import run_demo

    done = run_demo(tmp_path, num_eval=100)
    rows = {r["label"]: r for r in done["rows"]}
    assert set(rows) == {"xgblora (regular)", "lora (regular)", "xgblora (zo)", "lora (zo)"}
    assert not done["failed"]
    for label, row in rows.items():
        results = json.loads((tmp_path / f"custom-{label.replace(' (', '-').rstrip(')')}-seed0" / "results.json")
                             .read_text())
        assert row["test_mean"] == results["accuracy"]
        assert results["accuracy"] >= done["untrained_accuracy"] + 0.10, (label, results["accuracy"])
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert (tmp_path / "report.html").read_text().count("<tr") >= 5
