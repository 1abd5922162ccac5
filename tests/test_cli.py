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


@pytest.mark.parametrize("task", list(TASKS))
def test_eval_each_glue_task(glue_data, tmp_path, capsys, task):
    assert (glue_data / TASKS[task]).is_dir()
    out = tmp_path / "eval"
    code = cli.main(["eval", "--model_name", "tiny-opt", "--task_name", task, "--data_dir", str(glue_data),
                     "--num_eval", "8", "--max_length", "256", "--output_dir", str(out), "--device", "cpu"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved == printed
    assert 0.0 <= saved["accuracy"] <= 1.0
    assert saved["num_eval"] == 8 and saved["method"] == "none" and saved["task"] == task


# malformed input through the CLI, one line and exit code 2 each: test_malformed_inputs.py


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_help(capsys, command):
    with pytest.raises(SystemExit) as info:
        cli.main(([command] if command else []) + ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: xgblora" in out
    if command == "train":
        assert "--learning_rate" in out and "--resume_from_checkpoint" in out
    if command == "eval":
        assert "--num_train" in out and "--learning_rate" not in out


def test_console_script_error_exit_code(glue_data, tmp_path):
    script = Path(sys.executable).with_name("xgblora")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "xgblora.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command + ["eval", "--task_name", "NoSuchTask", "--data_dir", str(glue_data)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xgblora eval: error:") and "NoSuchTask" in lines[0], done.stderr


def test_compare_writes_runs_and_report_then_reuses_and_overwrites(glue_data, tmp_path, capsys):
    root = tmp_path / "cmp"
    args = ["compare", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data),
            "--methods", "xgblora", "lora", "--seeds", "0", "--trainer", "regular", "--max_steps", "4",
            "--logging_steps", "1", "--xgblora_steps_per_iteration", "2", "--learning_rate", "3e-3",
            "--num_train", "16", "--num_eval", "8", "--max_length", "128", "--output_root", str(root),
            "--device", "cpu"]
    assert cli.main(args) == 0
    runs = [root / "SST2-xgblora-regular-seed0", root / "SST2-lora-regular-seed0"]
    for run in runs:
        results = json.loads((run / "results.json").read_text())
        assert results["steps"] == 4 and "accuracy" in results
        assert not (run / "mezo_result.json").exists()
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


def test_train_trains_by_default_and_mezo_keeps_run_py_defaults(glue_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    common = ["--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data), "--num_eval", "8",
              "--max_length", "64", "--device", "cpu"]
    assert cli.main(["train", *common, "--num_train", "16", "--max_steps", "2", "--output_dir", "t"]) == 0
    trained = json.loads((tmp_path / "t" / "results.json").read_text())
    assert (trained["trainer"], trained["steps"]) == ("regular", 2)  # AdamW when --trainer is not given

    assert cli.main(["mezo", *common, "--output_dir", "m"]) == 0  # MeZO's run.py: zero-shot, result/ copy
    evaluated = json.loads((tmp_path / "m" / "results.json").read_text())
    assert (evaluated["trainer"], evaluated["num_demos"]) == ("none", 0)
    assert json.loads((tmp_path / "result" / "SST2-tiny-opt-sampleeval8-trainset0.json").read_text()) == evaluated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "result", "t"]
    capsys.readouterr()


# every command's options are checked before torch and transformers are imported (seconds on a small machine)
BAD_OPTIONS = [["train", "--bogus"], ["train", "--learning_rate", "nan"], ["eval", "--lora", "--xgblora"],
               ["mezo", "--max_length", "1"], ["generate", "--input_file", "p.jsonl", "--temperature", "nan"],
               ["chat", "--top_p", "0"], ["compare", "--learning_rate", "inf"], ["grpo", "--train_file", "t.jsonl",
                                                                                 "--epsilon", "-1"]]
LIGHT = """
import json, sys
from xgblora import cli
codes = [cli.main(argv) for argv in json.loads(sys.argv[1])]
print(json.dumps([codes, sorted(m for m in ("torch", "transformers", "accelerate", "datasets") if m in sys.modules)]))
"""


def test_bad_options_fail_before_the_heavy_imports():
    done = subprocess.run([sys.executable, "-c", LIGHT, json.dumps(BAD_OPTIONS)], capture_output=True, text=True,
                          timeout=120)
    codes, imported = json.loads(done.stdout)
    assert codes == [2] * len(BAD_OPTIONS), done.stderr
    assert len(done.stderr.splitlines()) == len(BAD_OPTIONS), done.stderr  # one line each
    assert imported == [], imported
