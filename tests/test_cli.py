"""The `xgblora` command in-process (cli.main) and once through the real console script: eval, errors, compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xgblora import cli

TASKS = {"SST2": "sst2", "RTE": "rte", "CB": "cb", "BoolQ": "boolq", "Copa": "copa", "WIC": "wic", "WSC": "wsc",
         "MultiRC": "multirc"}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """MeZO-style result copies land in ./result: keep them in the test's folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def one_line_error(capsys, code: int) -> str:
    """Assert exit code 2 and a single-line stderr message; return it."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("task", list(TASKS))
def test_eval_each_shared_task(shared_data, tmp_path, capsys, task):
    assert (shared_data / TASKS[task]).is_dir()
    out = tmp_path / "eval"
    code = cli.main(["eval", "--model_name", "tiny-opt", "--task_name", task, "--data_dir", str(shared_data),
                     "--num_eval", "20", "--max_length", "256", "--output_dir", str(out), "--device", "cpu"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved == printed
    assert 0.0 <= saved["accuracy"] <= 1.0
    assert saved["num_eval"] == 20 and saved["method"] == "none" and saved["task"] == task


def test_unknown_task(shared_data, capsys):
    code = cli.main(["eval", "--task_name", "NoSuchTask", "--data_dir", str(shared_data), "--num_eval", "4"])
    assert "NoSuchTask" in one_line_error(capsys, code)


def test_unknown_model_fails_fast_offline(shared_data, capsys):
    code = cli.main(["eval", "--model_name", "no-such-org/no-such-model", "--task_name", "SST2",
                     "--data_dir", str(shared_data), "--num_eval", "4"])
    assert "no-such-org/no-such-model" in one_line_error(capsys, code)


def test_malformed_custom_train_file_names_file_line_and_field(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "good film", "label": 1}\n{"text": "bad film", "label": 7}\n'
                    '{"text": "fine", "label": 0}\n', encoding="utf-8")
    code = cli.main(["train", "--task_name", "custom", "--train_file", str(path), "--template", "{text} It was",
                     "--label_words", "terrible,great", "--num_train", "2", "--trainer", "regular",
                     "--method", "lora", "--max_steps", "1", "--output_dir", str(tmp_path / "run")])
    message = one_line_error(capsys, code)
    assert f"{path}:2" in message and "label" in message


def test_malformed_json_line(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "good film", "label": 1}\n{"text": "bad film", "label": \n', encoding="utf-8")
    code = cli.main(["train", "--task_name", "custom", "--train_file", str(path), "--template", "{text} It was",
                     "--label_words", "terrible,great", "--num_train", "1", "--trainer", "regular",
                     "--method", "lora", "--max_steps", "1", "--output_dir", str(tmp_path / "run")])
    assert f"{path}:2" in one_line_error(capsys, code)


def test_missing_task_folder_in_data_dir(tmp_path, capsys):
    empty = tmp_path / "data"
    empty.mkdir()
    code = cli.main(["eval", "--task_name", "RTE", "--data_dir", str(empty), "--num_eval", "4"])
    assert str(empty) in one_line_error(capsys, code)


def test_bad_yaml_key(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("task_name: SST2\nlearnin_rate: 0.001\n", encoding="utf-8")
    code = cli.main(["train", "--config", str(path)])
    message = one_line_error(capsys, code)
    assert "learnin_rate" in message and "learning_rate" in message and str(path) in message


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_help(capsys, command):
    with pytest.raises(SystemExit) as info:
        cli.main(([command] if command else []) + ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: xgblora" in out
    if command in ("train", "eval"):
        assert "--learning_rate" in out and "--resume_from_checkpoint" in out


def test_console_script_error_exit_code(shared_data, tmp_path):
    script = Path(sys.executable).with_name("xgblora")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "xgblora.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command + ["eval", "--task_name", "NoSuchTask", "--data_dir", str(shared_data)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xgblora eval: error:") and "NoSuchTask" in lines[0], done.stderr


def test_compare_writes_runs_and_report_then_reuses_and_overwrites(shared_data, tmp_path, capsys):
    root = tmp_path / "cmp"
    args = ["compare", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(shared_data),
            "--methods", "xgblora", "lora", "--seeds", "0", "--trainer", "regular", "--max_steps", "4",
            "--logging_steps", "1", "--xgblora_steps_per_iteration", "2", "--learning_rate", "3e-3",
            "--num_train", "16", "--num_eval", "8", "--max_length", "128", "--output_root", str(root),
            "--device", "cpu"]
    assert cli.main(args) == 0
    runs = [root / "SST2-xgblora-regular-seed0", root / "SST2-lora-regular-seed0"]
    for run in runs:
        results = json.loads((run / "results.json").read_text())
        assert results["steps"] == 4 and "accuracy" in results
        assert json.loads((run / "mezo_result.json").read_text()) == results
    for name in ("loss.png", "report.html", "report.md"):
        assert (root / name).is_file() and (root / name).stat().st_size > 0, name
    assert "report:" in capsys.readouterr().out

    old = 1_000_000_000
    for run in runs:
        os.utime(run / "results.json", (old, old))
    assert cli.main(args) == 0
    assert all((run / "results.json").stat().st_mtime == old for run in runs)  # reused, not rerun

    assert cli.main(args + ["--overwrite"]) == 0
    assert all((run / "results.json").stat().st_mtime > old for run in runs)
