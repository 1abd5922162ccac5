"""The run lock: a second run into a busy output folder stops at once naming the holder; a dead holder's lock is
taken over with a message."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import make_cfg

from xgblora.errors import UserError
from xgblora.recipes import sft
from xgblora.train import lock
from xgblora.train.lock import LOCK_NAME, run_lock


def race_args(glue_data: Path, out: Path) -> list[str]:
    """A LoRA run long enough (3000 steps) to still hold its lock when the other run gives up."""
    return ["train", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data),
            "--num_train", "32", "--num_eval", "8", "--no_eval", "--method", "lora", "--trainer", "regular", "--max_steps", "3000",
            "--max_length", "32", "--per_device_train_batch_size", "4", "--save_strategy", "no",
            "--output_dir", str(out), "--result_file", str(out / "mezo.json"), "--device", "cpu"]


def xgblora_command() -> list[str]:
    script = Path(sys.executable).with_name("xgblora")
    return [str(script)] if script.exists() else [sys.executable, "-m", "xgblora.cli"]


def test_two_runs_racing_for_one_folder_one_stops_at_once_naming_the_other(glue_data, tmp_path, xgblora_log):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(xgblora_command() + race_args(glue_data, out), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        assert winner.poll() is None, "the winner should still be training"
        stderr = loser.stderr.read()
        assert loser.returncode == 2, stderr
        assert stderr.splitlines() == [stderr.strip()] and "Traceback" not in stderr, stderr
        assert f"{out} is in use by another run (process {winner.pid} on host {socket.gethostname()}" in stderr
        assert "trainable parameters" not in stderr  # stopped before loading the model
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] == winner.pid
        winner.send_signal(signal.SIGKILL)
        winner.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    # the killed run's lock file stays; the next run takes it over, saying whose it was, and removes it at the end
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == winner.pid
    sft.run(make_cfg(glue_data, out, max_steps=2, overwrite_output_dir=True, save_strategy="no", no_eval=True))
    taken = [r.getMessage() for r in xgblora_log.records if "taking over the lock" in r.getMessage()]
    assert len(taken) == 1 and f"process {winner.pid} on host" in taken[0], taken
    assert (out / "results.json").is_file() and not (out / LOCK_NAME).exists()


def test_a_finished_or_failed_run_releases_the_lock(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), run_lock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        raise RuntimeError("boom")
    assert not (tmp_path / LOCK_NAME).exists()
    with run_lock(tmp_path):
        pass


def test_a_lock_file_from_another_host_is_not_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node-7", "pid": 4242, "started": "2024-06-11 10:00:00"}))
    refused = pytest.raises(UserError, match=r"names a run on another host \(process 4242 on host node-7, .*delete")
    with refused, run_lock(tmp_path):
        pytest.fail("the lock should not be taken")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"


def test_a_file_system_without_locks_warns_and_runs_unlocked(tmp_path, monkeypatch, xgblora_log):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)
    with run_lock(tmp_path):
        pass
    assert any("cannot lock it" in r.getMessage() and "No locks available" in r.getMessage()
               for r in xgblora_log.records)
