"""Reliability: any bytes in a data file load or fail as one-line UserErrors; SIGKILL at random moments resumes exactly."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

# faults and helpers are modules in tests/ (not a package, so they are imported by module name)
from faults import KILLED, ForkServer, run_dying_on_write
from helpers import adapter, assert_same_tensors, interrupt_at, make_cfg, records, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from xgblora import checkpoint, cli
from xgblora.config import Config
from xgblora.data.sources import read_jsonl
from xgblora.data.splits import load_rows
from xgblora.data.tasks import Task, get_task
from xgblora.errors import UserError
from xgblora.recipes import sft
from xgblora.train import objective

# ----------------------------------------------------------------------------- data files: any input, clean errors

CUSTOM = dict(template="Review: {text} It was", label_words="bad,good", label_names="neg,pos")

# the fields each task reads, and values of the right kind that let a row get past a field (or nearly)
FIELDS: dict[str, dict[str, list]] = {
    "sst2": {"sentence": ["a fine film", " ", ""], "label": [0, 1, 2, -1, True, "1"]},
    "rte": {"premise": ["It rains.", ""], "hypothesis": ["It is wet.", "  "],
            "label": ["entailment", "not_entailment", 0, 1, 2, False, "neutral"]},
    "copa": {"premise": ["The man fell.", "."], "choice1": ["He slipped.", "I ran", ""], "choice2": ["He sang.", " "],
             "question": ["cause", "effect", 0, 1, "why"], "label": [0, 1, 5, True]},
    "multirc": {"paragraph": ["<b>Sent 1: </b>Text.<br>"], "question": ["Why?"], "answer": ["", "Because."],
                "label": [0, 1, True, "0"], "passage": [{"text": "Text.", "questions": []}]},
    "custom": {"text": ["great stuff", ""], "label": ["neg", "pos", 0, 1, 2, "bad", True]},
}


def task_for(name: str, path: Path) -> Task:
    if name == "custom":
        return get_task("custom", Config(task_name="custom", train_file=str(path), **CUSTOM).data)
    return get_task(name)


def check_loading(name: str, data: bytes) -> None:
    """Write data as the task's train file and load it two ways: success, or a one-line UserError naming the file."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data"
        path = folder / name / "train.jsonl"
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        task = task_for(name, path)
        for load in (lambda: [ex for n, row in read_jsonl(path) for ex in task.examples(row, (str(path), n))],
                     lambda: load_rows(task, "train", None if name == "custom" else str(folder))):
            try:
                examples = load()
            except UserError as exc:
                message = str(exc)
                assert message.splitlines() == [message] and "\r" not in message, repr(message)
                assert str(path) in message, message
            else:
                assert all(ex.prompt and isinstance(ex.gold, tuple) for ex in examples)  # MultiRC: 0 questions -> []


TASK_NAMES = list(FIELDS)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def rows_for(name: str) -> st.SearchStrategy:
    """Dicts biased toward the task's own fields, each holding a plausible value or any JSON value."""
    fields = FIELDS[name]
    value = {key: st.sampled_from(good) | json_values | st.text(max_size=6) for key, good in fields.items()}
    if name == "multirc":  # the nested SuperGLUE layout: passage.questions[].answers[]
        answer = st.fixed_dictionaries({}, optional={"text": value["answer"], "label": value["label"]})
        question = st.fixed_dictionaries({}, optional={"question": value["question"],
                                                       "answers": st.lists(answer | json_values, max_size=3)})
        passage = st.fixed_dictionaries({}, optional={"text": value["paragraph"],
                                                      "questions": st.lists(question | json_values, max_size=3)})
        value["passage"] = passage | json_values
    extra = st.dictionaries(st.text(max_size=8), json_values, max_size=2)
    return st.builds(lambda known, more: {**more, **known}, st.fixed_dictionaries({}, optional=value), extra)


def lines_of(values: list) -> bytes:
    return b"".join(json.dumps(v).encode() + b"\n" for v in values)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", TASK_NAMES)
@SETTINGS
@given(data=st.binary(max_size=200)
       | st.lists(st.binary(max_size=30) | st.sampled_from([b"{}", b"[]", b"null", b"\xef\xbb\xbf{}", b"{\"label\": 1}",
                                                            b"\r", b" ", b"\xff", b"{\"a\": \"\\ud800\"}", b"NaN"]),
                  max_size=6).map(b"\n".join))
def test_random_bytes_load_or_raise_a_one_line_user_error(name, data):
    check_loading(name, data)


@pytest.mark.parametrize("name", TASK_NAMES)
@SETTINGS
@given(values=st.lists(json_values, max_size=4))
def test_random_json_values_load_or_raise_a_one_line_user_error(name, values):
    check_loading(name, lines_of(values))


@pytest.mark.parametrize("name", TASK_NAMES)
@SETTINGS
@given(values=st.data())
def test_rows_with_the_task_fields_load_or_raise_a_one_line_user_error(name, values):
    rows = values.draw(st.lists(rows_for(name) | json_values, min_size=1, max_size=4))
    check_loading(name, lines_of(rows))


@pytest.mark.parametrize("line", [b"1" * 5000, b'{"label": ' + b"9" * 5000 + b"}", b"[" * 100_000,
                                  b'{"sentence": ' + b'{"a": ' * 50_000 + b"}" * 50_000 + b"}"],
                         ids=["huge-int", "huge-int-field", "deep-array", "deep-object"])
def test_json_python_cannot_hold_is_a_user_error(tmp_path, line):
    """Valid-looking JSON that json.loads rejects with ValueError/RecursionError (not JSONDecodeError)."""
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"sentence": "ok", "label": 1}\n' + line + b"\n")
    with pytest.raises(UserError, match=r"train\.jsonl:2: not valid JSON") as info:
        read_jsonl(path)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- SIGKILL at random moments

MAX_STEPS, SAVE_STEPS = 24, 2
# the soak: 10 kills take about a minute on 2 cores; set XGBLORA_TEST_KILLS for a longer one
KILLS = max(1, int(os.environ.get("XGBLORA_TEST_KILLS", "10")))
TIMING = {"train_runtime_s", "steps_per_second", "peak_memory_mb", "resumes"}  # fields of a run's time and parts


def kill_args(glue_data: Path, out: Path) -> list[str]:
    """A small XGBLoRA + AdamW run: merges every 4 steps, a checkpoint every 2 (keeping 2), a record every step."""
    return ["train", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data),
            "--num_train", "32", "--num_eval", "8", "--no_eval", "--method", "xgblora", "--trainer", "regular",
            "--xgblora_steps_per_iteration", "4", "--xgblora_layers_per_booster", "1",
            "--lora_target_modules", "q_proj,v_proj,fc1", "--learning_rate", "3e-3",
            "--lr_scheduler_type", "constant", "--max_steps", str(MAX_STEPS), "--logging_steps", "1",
            "--save_steps", str(SAVE_STEPS), "--save_total_limit", "2", "--max_length", "32",
            "--per_device_train_batch_size", "4", "--output_dir", str(out), "--result_file", str(out / "mezo.json"),
            "--device", "cpu", "--seed", "3"]


def training_started(pid: int, metrics: Path) -> bool:
    """Whether process `pid` holds metrics.jsonl open, which its training loop does from its first step (Linux)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(metrics):
                return True
    return False


def wait_until(server: ForkServer, condition) -> int | None:
    """Wait until condition() holds (None) or the launch ends (its exit status)."""
    while (rc := server.wait(0.005)) is None and not condition():
        pass
    return rc


def due_or_saved(deadline: float, following: Path) -> bool:
    """Whether the deadline has passed or the checkpoint `following` exists."""
    return time.monotonic() >= deadline or following.is_dir()


def kill_and_resume(server: ForkServer, args: list[str], out: Path, logs: Path, kill_at: list[float],
                    step_s: float) -> list:
    """Launch the run, SIGKILL launch i at kill_at[i] (in steps: 7.5 is half-way through step 8; a launch resumed
    past it dies within its first half step), and resume (or restart when no checkpoint exists yet) until a launch
    finishes. The moment is found from the checkpoint just before it, which the launch is seen to write, plus the
    rest at the launch's own pace (`step_s` seconds a step until it is measured). Returns (resumed?, exit status)
    per launch."""
    rng, metrics, history = random.Random(len(kill_at)), Path(os.path.realpath(out / "metrics.jsonl")), []
    for launch in range(len(kill_at) + 3):
        found = checkpoint.step_checkpoints(out / "checkpoints")
        extra = ["--resume_from_checkpoint", "latest"] if found else ["--overwrite_output_dir"]
        resumed = int(found[-1].name.split("-")[1]) if found else 0
        stderr_path = logs / f"stderr-{launch}.txt"
        pid = server.start(args + extra, stderr_path)
        rc = wait_until(server, partial(training_started, pid, metrics)) if launch < len(kill_at) else None
        if launch < len(kill_at) and rc is None:
            at = max(kill_at[launch], resumed + rng.uniform(0, 0.5))
            before = max(resumed, int(at) - int(at) % SAVE_STEPS)  # the last checkpoint before the moment
            started, saved = time.monotonic(), out / "checkpoints" / f"step-{before}"
            if before > resumed and (rc := wait_until(server, saved.is_dir)) is None:
                step_s = (time.monotonic() - started) / (before - resumed)  # this launch's pace, on a busy machine
            # at this pace, but never past the next checkpoint: a pace measured over a slow first step (a loaded
            # machine) would otherwise wait out the rest of the run
            due = partial(due_or_saved, time.monotonic() + (at - before) * step_s,
                          saved.with_name(f"step-{before + SAVE_STEPS}"))
            if rc is None and (rc := wait_until(server, due)) is None:
                os.kill(pid, signal.SIGKILL)
        rc = server.wait(120) if rc is None else rc
        history.append((bool(found), rc))
        if rc != -signal.SIGKILL:
            assert rc == 0, stderr_path.read_text(errors="replace")
            return history
    raise AssertionError(f"never finished: {history}")


def alongside_uninterrupted(glue_data: Path, tmp_path: Path, interrupted):
    """Run interrupted() in a thread (its subprocesses import torch meanwhile) while the uninterrupted reference
    run goes in the main thread (the run installs signal handlers); returns (interrupted()'s result, reference)."""
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(interrupted)
        whole = tmp_path / "whole"
        assert cli.main(kill_args(glue_data, whole)) == 0
        return done.result(), whole


def assert_same_run(out: Path, whole: Path) -> None:
    """The run in out finished with the reference's weights, metrics and results (timing fields aside), and every
    metrics line parses."""
    assert_same_tensors(adapter(out), adapter(whole))
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    assert records(out) == records(whole)
    assert [r["step"] for r in records(out) if "loss" in r] == list(range(1, MAX_STEPS + 1))
    got, expected = (json.loads((path / "results.json").read_text()) for path in (out, whole))
    assert {k: v for k, v in got.items() if k not in TIMING} == {k: v for k, v in expected.items() if k not in TIMING}
    assert got["steps"] == MAX_STEPS


@pytest.mark.slow
def test_sigkill_at_10_random_moments_then_resume_equals_an_uninterrupted_run(glue_data, tmp_path):
    whole, out = tmp_path / "whole", tmp_path / "killed"
    server = ForkServer()
    try:
        server.start(kill_args(glue_data, whole), tmp_path / "stderr-whole.txt")
        assert server.wait(120) == 0, (tmp_path / "stderr-whole.txt").read_text(errors="replace")
        step_s = json.loads((whole / "results.json").read_text())["train_runtime_s"] / MAX_STEPS
        # 10 moments spread at random over the first 85% of the run, one in each tenth of it: steps, merges and
        # checkpoint saves alike (found by progress, so that a loaded or fast machine still needs every kill)
        rng = random.Random(20240611)
        kill_at = [(i + rng.random()) / KILLS * 0.85 * MAX_STEPS for i in range(KILLS)]
        history = kill_and_resume(server, kill_args(glue_data, out), out, tmp_path, kill_at, step_s)
    finally:
        server.close()
    assert sum(rc == -signal.SIGKILL for _, rc in history) == KILLS, history
    resumed = sum(resumed for resumed, _ in history)
    assert resumed >= KILLS // 2, history
    # a resumed part killed before its next checkpoint left nothing behind, its resume included
    assert 1 <= json.loads((out / "results.json").read_text())["resumes"] <= resumed
    assert_same_run(out, whole)


# ----------------------------------------------------------------------------- SIGKILL inside a checkpoint save

# `python -c DYING_SAVE n ARGS...`: the xgblora command, except that its n-th checkpoint save writes half of the
# weights file and SIGKILLs the process (n = 0: never)
DYING_SAVE = """
import os, signal, sys
import safetensors.torch
from xgblora import cli
from xgblora.train import objective
from xgblora import train
from xgblora import checkpoint

at, calls, real = int(sys.argv[1]), [], checkpoint.save_file

def dying(tensors, filename, *args, **kwargs):
    calls.append(filename)
    if len(calls) == at:
        data = safetensors.torch.save(tensors)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tensors, filename, *args, **kwargs)

checkpoint.save_file = dying
sys.exit(cli.main(sys.argv[2:]))
"""


def dying_save_run(at: int, args: list[str], stderr_path: Path) -> int:
    """Run `xgblora ARGS` with its at-th checkpoint save killed mid-write (at 0: none); returns the exit status."""
    with open(stderr_path, "wb") as stderr:
        return subprocess.run([sys.executable, "-c", DYING_SAVE, str(at), *args], stdout=subprocess.DEVNULL,
                              stderr=stderr, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300).returncode


def test_sigkill_inside_a_checkpoint_save_keeps_the_last_whole_one_the_rerun_refuses_and_resume_is_exact(glue_data,
                                                                                                       tmp_path):
    out = tmp_path / "killed"
    root, args = out / "checkpoints", kill_args(glue_data, out)

    def killed_in_a_save_then_resumed() -> tuple:
        # saves come at steps 2, 4, ...: the 2nd (step 4) dies half-way through its weights file
        assert dying_save_run(2, args, tmp_path / "1.txt") == -signal.SIGKILL
        seen = (sorted(p.name for p in root.iterdir()), checkpoint.load_requested(root, "latest")[0].name,
                checkpoint.read_checkpoint(root / "step-2")[1]["step"], (out / "metrics.jsonl").read_text())
        with pytest.raises(Exception):  # noqa: B017 - the kill did land mid-write: the weights are cut short
            load_file(str(root / ".step-4.tmp" / checkpoint.WEIGHTS))
        before = snapshot(out)
        assert dying_save_run(0, args, tmp_path / "again.txt") == 2  # the identical command: refused, nothing changed
        refused = (tmp_path / "again.txt").read_text()
        assert refused.count("\n") == 1 and "Traceback" not in refused, refused
        assert f"{out} holds an interrupted run (last checkpoint {root / 'step-2'}); continue it with " \
               f"--resume_from_checkpoint latest, or start over with --overwrite_output_dir" in refused
        assert snapshot(out) == before and "xgblora.lock" in before  # the dead run's lock left as it was
        resumed = [*args, "--resume_from_checkpoint", "latest"]
        assert dying_save_run(0, resumed, tmp_path / "2.txt") == 0, (tmp_path / "2.txt").read_text(errors="replace")
        return seen

    (names, latest, step, metrics), whole = alongside_uninterrupted(glue_data, tmp_path,
                                                                    killed_in_a_save_then_resumed)
    assert (names, latest, step) == ([".step-4.tmp", "step-2"], "step-2", 2)  # the torn folder is not "latest"
    assert [json.loads(line)["step"] for line in metrics.splitlines()][-1] == 4  # flushed before the save
    assert_same_run(out, whole)


# ----------------------------------------------------------------------------- non-finite MeZO steps

@pytest.mark.parametrize(("method", "forwards"), [("lora", 1), ("ft", 2)], ids=["dual-batch", "two-pass"])
def test_mezo_skips_a_non_finite_step_like_a_zero_gradient_one_and_runs_on(glue_data, tmp_path, monkeypatch,
                                                                          method, forwards):
    """--nan_policy skip under MeZO: the step whose losses are NaN leaves the weights as a zero estimate would."""
    real = objective.per_example_loss

    def run(name: str, value: float) -> list[dict]:
        calls = []

        def loss_at_step_3(model, batch, *objectives):  # `forwards` calls per MeZO step
            calls.append(1)
            loss = real(model, batch, *objectives)
            return torch.full_like(loss, value) if 2 * forwards < len(calls) <= 3 * forwards else loss

        monkeypatch.setattr(objective, "per_example_loss", loss_at_step_3)
        out = tmp_path / name
        results = sft.run(make_cfg(glue_data, out, trainer="zo", method=method, learning_rate=1e-3,
                                     max_steps=6, logging_steps=1, nan_policy="skip", no_eval=True))
        assert results["steps"] == 6 and len(calls) == 6 * forwards
        return [r for r in records(out) if "loss" in r]

    skipped, zero = run("nan", float("nan")), run("zero", 0.0)
    assert [r["step"] for r in skipped] == list(range(1, 7))
    assert [r for r in skipped if r["step"] != 3] == [r for r in zero if r["step"] != 3]
    assert all(math.isfinite(r["loss"]) for r in skipped if r["step"] != 3)
    final = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert_same_tensors(load_file(str(tmp_path / "nan" / "final" / final)),
                        load_file(str(tmp_path / "zero" / "final" / final)))


# ----------------------------------------------------------------------------- SIGKILL while writing an output

def compare_args(glue_data: Path, root: Path) -> list[str]:
    return ["compare", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data),
            "--methods", "xgblora", "lora", "--seeds", "0", "--trainer", "regular", "--max_steps", "4",
            "--xgblora_steps_per_iteration", "2", "--num_train", "16", "--num_eval", "8", "--max_length", "32",
            "--output_root", str(root), "--device", "cpu"]


# the file whose opening for writing kills `xgblora compare`, and the output that must then not exist
COMPARE_KILLS = {"final": (r"^adapter_config\.json$", "SST2-xgblora-regular-seed0/final"),
                 "results": (r"results\.json", "SST2-xgblora-regular-seed0/results.json"),
                 "report": (r"report\.html", "report.html")}


@pytest.mark.parametrize("case", list(COMPARE_KILLS))
def test_compare_killed_while_writing_an_output_leaves_no_half_output_and_a_rerun_finishes(glue_data, tmp_path,
                                                                                          case):
    """Also: the first run's "running" line reaches the console (logging is set up before the first run)."""
    root, (pattern, output) = tmp_path / "cmp", COMPARE_KILLS[case]
    args = compare_args(glue_data, root)
    assert run_dying_on_write(pattern, args, tmp_path / "stderr.txt") == KILLED
    assert "SST2-xgblora-regular-seed0: running" in (tmp_path / "stderr.txt").read_text(errors="replace")
    assert not (root / output).exists()  # no half-written output that could pass for a finished one
    assert cli.main(args) == 0
    for name in ("SST2-xgblora-regular-seed0", "SST2-lora-regular-seed0"):
        assert json.loads((root / name / "results.json").read_text())["steps"] == 4
        assert load_file(str(root / name / "final" / "adapter_model.safetensors"))
    assert (root / "report.html").read_text().endswith("</html>\n")
    assert not [p for p in root.rglob("*") if p.name.endswith((".tmp", ".old", ".lock"))]


# ----------------------------------------------------------------------------- a full disk, a damaged checkpoint

def test_a_full_disk_at_a_checkpoint_stops_the_run_in_one_line_and_it_resumes_later(glue_data, tmp_path,
                                                                                  monkeypatch, capsys):
    out = tmp_path / "run"
    args = kill_args(glue_data, out)
    real, saves = checkpoint.save_file, []

    def disk_full_at_the_second_save(tensors, filename, *rest, **kwargs):
        saves.append(filename)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, *rest, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", disk_full_at_the_second_save)
    assert cli.main([*args, "--overwrite_output_dir"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("xgblora train: error: could not save checkpoint ")
    assert "step-4 (OSError: [Errno 28] No space left on device); it needs about" in errors[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]  # no .step-4.tmp
    assert not (out / "results.json").exists() and not (out / "xgblora.lock").exists()
    monkeypatch.setattr(checkpoint, "save_file", real)
    assert cli.main([*args, "--resume_from_checkpoint", "latest"]) == 0
    assert json.loads((out / "results.json").read_text())["resumes"] == 1


def test_a_damaged_newest_checkpoint_is_passed_over_and_the_resume_is_still_exact(glue_data, tmp_path,
                                                                                xgblora_log):
    overrides = dict(method="xgblora", max_steps=10, save_steps=3, xgblora_steps_per_iteration=4,
                     logging_steps=1, no_eval=True)
    whole, split = tmp_path / "whole", tmp_path / "split"
    expected = sft.run(make_cfg(glue_data, whole, **overrides))
    with pytest.raises(RuntimeError, match="simulated crash"):
        sft.run(make_cfg(glue_data, split, **overrides), hooks=interrupt_at(8, how="crash"))
    weights = split / "checkpoints" / "step-6" / checkpoint.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight: the file still loads, with another number in it
    weights.write_bytes(bytes(data))
    got = sft.run(make_cfg(glue_data, split, resume_from_checkpoint="latest", **overrides))
    messages = [r.getMessage() for r in xgblora_log.records]
    assert any("step-6: damaged checkpoint" in m and checkpoint.WEIGHTS in m for m in messages), messages
    assert any("resumed from" in m and m.endswith("step-3 at step 3") for m in messages), messages
    assert_same_tensors(adapter(split), adapter(whole))
    assert records(split) == records(whole)
    assert got["train_loss"] == expected["train_loss"]
