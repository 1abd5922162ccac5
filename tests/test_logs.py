"""MetricsLog (one handle, batched flushes, torn-line repair, TensorBoard mirror), read_metrics, console logging."""

import builtins
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xgblora.config import Config
from xgblora.data.batches import LabelBatch
from xgblora.errors import UserError
from xgblora.logs import MetricsLog, ProgressLine, read_metrics, setup_console_logging
from xgblora.models.pretrained import random_model
from xgblora.recipes import sft
from xgblora.trackers import open_trackers


def _records(n: int, start: int = 1) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "lr": 1e-5, "elapsed_s": 0.1 * s} for s in range(start, start + n)]


def test_records_parse_back(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    records = [*_records(5), {"step": 5, "eval_accuracy": 0.81}, {"step": 5, "event": "merge", "booster": 1, "modules": 48}]
    with MetricsLog(path) as log:
        for record in records:
            log.log(record)
    assert read_metrics(path) == records


def test_one_open_for_1000_records(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if Path(str(file)) == path:
            opened.append(args[0] if args else kwargs.get("mode"))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    with MetricsLog(path, flush_every=20) as log:
        for record in _records(1000):
            log.log(record)
    monkeypatch.undo()
    assert len(opened) == 1
    assert len(read_metrics(path)) == 1000


def test_flushes_every_n_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, flush_every=20, flush_interval_s=3600)
    visible = []
    for record in _records(65):
        log.log(record)
        visible.append(len(read_metrics(path)))
    assert visible[18] == 0 and visible[19] == 20 and visible[38] == 20 and visible[39] == 40 and visible[-1] == 60
    log.close()
    assert len(read_metrics(path)) == 65


def test_flush_interval_writes_slow_records_promptly(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, flush_every=100, flush_interval_s=0.0) as log:
        log.log({"step": 1, "loss": 0.5})
        assert read_metrics(path) == [{"step": 1, "loss": 0.5}]


def test_flush_makes_records_visible_and_fsyncs(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    with MetricsLog(path, flush_every=100, flush_interval_s=3600) as log:
        for record in _records(3):
            log.log(record)
        assert read_metrics(path) == []
        log.flush()
        assert read_metrics(path) == _records(3)
        assert len(synced) == 1


def test_fresh_log_starts_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n')
    with MetricsLog(path) as log:
        log.log({"step": 1, "loss": 0.5})
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}]


def test_torn_last_line_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for record in _records(3):
            log.log(record)
    with open(path, "ab") as handle:
        handle.write(b'{"step": 4, "loss": 0.2')  # a kill mid-write
    with pytest.warns(UserWarning, match="torn last line"):
        log = MetricsLog(path, resume=True)
    with log:
        log.log({"step": 4, "loss": 0.25})
    assert read_metrics(path) == [*_records(3), {"step": 4, "loss": 0.25}]


def test_resume_drops_records_after_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for record in _records(10):
            log.log(record)
    with MetricsLog(path, resume=True, resume_step=6) as log:
        log.log({"step": 7, "loss": 0.7})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6, 7]


def test_resume_keeps_whole_last_record_without_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}')
    with MetricsLog(path, resume=True) as log:
        log.log({"step": 3, "loss": 0.3})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_read_metrics_skips_torn_last_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    with caplog.at_level(logging.WARNING, logger="xgblora"):
        assert read_metrics(path) == [{"step": 1, "loss": 0.5}]
    assert "torn last line" in caplog.text


def test_read_metrics_names_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: "):
        read_metrics(path)


def test_log_rejects_a_record_without_step_and_writes_numpy_like_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        with pytest.raises(ValueError, match="step"):
            log.log({"loss": 1.0})
        torch = pytest.importorskip("torch")
        log.log({"step": 1, "loss": torch.tensor(0.5)})
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}]


def test_tensorboard_mirror_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tensorboard"
    with MetricsLog(tmp_path / "metrics.jsonl", trackers=open_trackers(("tensorboard",), tmp_path, "run", {})) as log:
        for record in _records(5):
            log.log(record)
        log.log({"step": 5, "eval_accuracy": 0.8})
        log.log({"step": 5, "event": "merge", "booster": 1, "modules": 48})
    assert list(tb_dir.glob("events.out.tfevents*"))
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/accuracy", "merge/booster", "merge/modules"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]


def test_report_to_several_trackers_in_a_run(glue_data, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    sft.run(Config(model_name="tiny-opt", task_name="SST2", data_dir=str(glue_data), num_train=16, num_eval=4,
                     max_steps=4, logging_steps=1, method="lora", max_length=64, device="cpu", save_strategy="no",
                     output_dir=str(out), report_to="tensorboard,mlflow"))
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("xgblora").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(losses)
    assert run.data.params["method"] == "lora"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing in the working directory


def test_unknown_tracker_is_a_one_line_error():
    with pytest.raises(UserError, match=r"--report_to 'tensorboard,neptune': unknown tracker 'neptune'"):
        Config(report_to="tensorboard,neptune")


def test_progress_lines_when_the_log_is_not_a_terminal(caplog):
    line = ProgressLine(max_steps=100, start_step=0, enabled=True)
    ones = torch.ones(2, 2500, dtype=torch.long)
    line.count(LabelBatch(input_ids=ones, attention_mask=ones, labels=torch.zeros(2, dtype=torch.long)))
    assert line.tokens == 5000
    with caplog.at_level(logging.INFO, logger="xgblora"):
        line.report(10, 1.23456, 3e-4)
    (message,) = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"step 10/100  loss 1\.2346  lr 0\.0003  \d+ tokens/s  ETA \d+m\d\ds", message), message


def test_console_logging_is_idempotent(capsys):
    logger = setup_console_logging()
    try:
        assert setup_console_logging(logging.WARNING) is logger
        # pytest adds its own capture handlers to a non-propagating logger; count only ours
        assert sum(type(h).__name__ == "_ConsoleHandler" for h in logger.handlers) == 1
        logger.info("hidden")
        logger.warning("shown once")
        err = capsys.readouterr().err
        assert "hidden" not in err and err.count("shown once") == 1 and err.count("\n") == 1
    finally:
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def test_a_log_that_is_no_terminal_gets_no_colour_codes_or_carriage_returns(glue_data, tmp_path):
    """transformers draws a progress bar over the weights it loads and writes its load report's header in bold,
    terminal or not (a classifier head new to a saved model makes it report)."""
    model, tokenizer = random_model("tiny-bert")
    model.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    done = subprocess.run([sys.executable, "-m", "xgblora.cli", "eval", "--model_name", str(tmp_path / "bert"),
                           "--head", "classifier", "--task_name", "SST2", "--data_dir", str(glue_data),
                           "--num_eval", "2", "--max_length", "16", "--output_dir", str(tmp_path / "out"),
                           "--device", "cpu"], capture_output=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if "PROGRESS_BARS" not in k})
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"LOAD REPORT" in done.stderr  # the report is there, in plain text
    assert b"\x1b" not in done.stderr and b"\r" not in done.stderr, done.stderr
