"""No command writes over a file it did not create: an empty output path, a folder of the user's own files, a
config.yaml that no run wrote (the --config file itself) and a folder the process cannot write in are each refused
in one line (exit 2) before any model loads, while an earlier run's folder is still resumed or redone; a full disk
while an export writes is one line too, naming the output, and leaves nothing under its name."""

from __future__ import annotations

import errno
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from faults import read_only
from helpers import snapshot
from safetensors import SafetensorError

from xgblora import cli
from xgblora.models import pretrained

ROWS = [{"prompt": f"What is {i} plus 1?", "completion": f"{i + 1}"} for i in range(8)]


def one_line_error(capsys) -> str:
    """The one error line on stderr (a progress bar the error cut short may stand before it)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def _rows(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _train_args(data: Path, out: str, *extra: str) -> list[str]:
    return ["train", "--model_name", "tiny-llama-chat", "--task_name", "custom", "--train_file", str(data),
            "--method", "lora", "--max_steps", "2", "--save_steps", "1", "--per_device_train_batch_size", "4",
            "--no_eval", "--device", "cpu", "--output_dir", out, *extra]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a model loads: each refusal here comes first."""
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(pretrained, "load", load)


# ----------------------------------------------------------------------------- an empty output path

EMPTY = {
    "train": (["train", "--output_dir", ""], "--output_dir"),
    "train --result_file": (["train", "--result_file", ""], "--result_file"),
    "eval": (["eval", "--output_dir", ""], "--output_dir"),
    "dpo": (["dpo", "--train_file", "p.jsonl", "--output_dir", ""], "--output_dir"),
    "grpo": (["grpo", "--train_file", "q.jsonl", "--output_dir", ""], "--output_dir"),
    "rft": (["rft", "--train_file", "q.jsonl", "--eval_file", "h.jsonl", "--output_root", ""], "--output_root"),
    "compare": (["compare", "--output_root", ""], "--output_root"),
    "compare --loss_figure_path": (["compare", "--loss_figure_path", ""], "--loss_figure_path"),
    "generate": (["generate", "--input_file", "p.jsonl", "--output_file", ""], "--output_file"),
    "export": (["export", "run", "--output_dir", ""], "--output_dir"),
    "export gguf": (["export", "run", "--format", "gguf", "--output_file", ""], "--output_file"),
    "export modelfile": (["export", "run", "--format", "gguf", "--output_file", "m.gguf", "--ollama_modelfile", ""],
                         "--ollama_modelfile"),
    "encode": (["encode", "tiny-bert", "--input_file", "t.jsonl", "--output_file", ""], "--output_file"),
    "mine": (["mine", "tiny-bert", "--input_file", "p.jsonl", "--output_file", ""], "--output_file"),
    "bench": (["bench", "--json", ""], "--json"),
    "demo": (["demo", "--output_root", ""], "--output_root"),
}


@pytest.mark.parametrize("case", list(EMPTY))
def test_an_empty_output_path_is_refused_in_one_line(tmp_path, monkeypatch, capsys, no_model_loads, case):
    """Path("") is the working directory: the command would write its outputs in among the files there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("a user's file")
    args, flag = EMPTY[case]
    assert cli.main(args) == 2
    assert f"error: {flag} is empty; give the path to write to" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_a_config_file_saying_output_dir_empty_or_its_own_folder_is_never_written_over(tmp_path, monkeypatch,
                                                                                      capsys, no_model_loads):
    """The --config file in the working directory, named config.yaml: the name a run writes its options to."""
    monkeypatch.chdir(tmp_path)
    data = _rows(tmp_path / "rows.jsonl")
    for output_dir, message in (("", "--output_dir is empty"), (".", "which is this file")):
        text = f"model_name: tiny-llama-chat\ntask_name: custom\ntrain_file: rows.jsonl\noutput_dir: '{output_dir}'\n"
        (tmp_path / "config.yaml").write_text(text)
        assert cli.main(["train", "--config", "config.yaml", "--max_steps", "1", "--device", "cpu"]) == 2
        assert message in one_line_error(capsys)
        assert (tmp_path / "config.yaml").read_text() == text
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", data.name]


# ----------------------------------------------------------------------------- a folder of the user's own files

def test_a_run_into_a_folder_of_other_files_is_refused_even_to_start_over(tmp_path, capsys, no_model_loads):
    data = _rows(tmp_path / "rows.jsonl")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(folder)
    for extra in ([], ["--overwrite_output_dir"], ["--resume_from_checkpoint", "latest"]):
        assert cli.main(_train_args(data, str(folder), *extra)) == 2
        err = one_line_error(capsys)
        assert f"--output_dir {folder}: the folder holds files that are not an xgblora run's (metrics.jsonl, " \
               f"notes.txt)" in err
        assert snapshot(folder) == before


def test_a_config_yaml_no_run_wrote_is_refused_even_beside_a_run(tmp_path, capsys, no_model_loads):
    data = _rows(tmp_path / "rows.jsonl")
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text("learning_rate: 0.1  # my own settings\n")
    before = snapshot(folder)
    assert cli.main(_train_args(data, str(folder), "--overwrite_output_dir")) == 2
    assert "its config.yaml was not written by xgblora" in one_line_error(capsys)
    assert snapshot(folder) == before


@pytest.mark.parametrize("command", ["compare", "rft"])
def test_compare_and_rft_refuse_an_output_root_of_other_files(tmp_path, capsys, no_model_loads, command):
    root = tmp_path / "root"
    root.mkdir()
    (root / "report.md").write_text("my report")
    data = _rows(tmp_path / "rows.jsonl")
    args = {"compare": ["compare", "--task_name", "custom", "--train_file", str(data)],
            "rft": ["rft", "--train_file", str(data), "--eval_file", str(data), "--model_name", "tiny-llama-chat"]}
    assert cli.main([*args[command], "--output_root", str(root)]) == 2
    assert f"--output_root {root}: the folder holds files that are not" in one_line_error(capsys)
    assert sorted(p.name for p in root.iterdir()) == ["report.md"]


def test_an_earlier_runs_folder_is_still_resumed_and_redone(tmp_path, capsys):
    """Its config.yaml is the run's own (marked, or written before the mark by every option it holds): resumed
    from its checkpoints, started over, and repeated with --config from that very file."""
    from xgblora import outputs

    data = _rows(tmp_path / "rows.jsonl")
    out = tmp_path / "run"
    args = _train_args(data, str(out))
    assert cli.main(args) == 0
    config = out / "config.yaml"
    assert config.read_text().startswith(outputs.CONFIG_HEADER + "\n") and outputs.holds_run(out)
    (out / "results.json").unlink()  # an interrupted run: checkpoints and no results
    config.write_text(config.read_text().split("\n", 1)[1])  # as a run wrote it before the header
    assert cli.main([*args, "--resume_from_checkpoint", "latest"]) == 0
    assert cli.main([*args, "--overwrite_output_dir"]) == 0
    assert cli.main(["train", "--config", str(config), "--overwrite_output_dir", "--max_steps", "1"]) == 0
    assert json.loads((out / "results.json").read_text())["steps"] == 1
    assert yaml.safe_load(config.read_text())["max_steps"] == 1


# ----------------------------------------------------------------------------- a folder that cannot be written in

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished LoRA run of tiny-llama-chat (a model GGUF export writes)."""
    tmp = tmp_path_factory.mktemp("run")
    assert cli.main(_train_args(_rows(tmp / "rows.jsonl"), str(tmp / "run"), "--save_strategy", "no")) == 0
    return tmp / "run"


def _unwritable_commands(run: Path, folder: Path, data: Path) -> dict[str, list[str]]:
    return {"export gguf": ["export", str(run), "--format", "gguf", "--output_file", str(folder / "m.gguf")],
            "export merged": ["export", str(run), "--format", "merged", "--output_dir", str(folder / "merged")],
            "generate": ["generate", "--input_file", str(data), "--output_file", str(folder / "out.jsonl"),
                         "--device", "cpu"],
            "mine": ["mine", "tiny-bert", "--input_file", str(data), "--output_file", str(folder / "neg.jsonl")],
            "bench": ["bench", "--json", str(folder / "bench.json")],
            "train": _train_args(data, str(folder / "run"))}


@pytest.mark.parametrize("command", ["export gguf", "export merged", "generate", "mine", "bench", "train"])
def test_an_output_folder_that_cannot_be_written_in_is_one_line_before_the_model_loads(
        finished_run, tmp_path, capsys, no_model_loads, command):
    if command == "export gguf" and importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf package")
    data = _rows(tmp_path / "rows.jsonl")
    folder = tmp_path / "read-only"
    folder.mkdir()
    args = _unwritable_commands(finished_run, folder, data)[command]
    with read_only(folder):
        assert cli.main(args) == 2
    err = one_line_error(capsys)
    assert f"cannot write in {folder} (Read-only file system); choose a folder you can write to" in err
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("command", ["export gguf", "export merged", "generate", "mine", "bench", "train"])
def test_an_output_path_under_a_file_is_one_line_before_the_model_loads(finished_run, tmp_path, capsys,
                                                                        no_model_loads, command):
    if command == "export gguf" and importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf package")
    data = _rows(tmp_path / "rows.jsonl")
    (tmp_path / "file").write_text("a file")
    assert cli.main(_unwritable_commands(finished_run, tmp_path / "file" / "sub", data)[command]) == 2
    assert f"{tmp_path / 'file'} is a file, not a folder; choose another path" in one_line_error(capsys)


# ----------------------------------------------------------------------------- a full disk during an export

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _no_space_in_safetensors(*args, **kwargs):
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("writer", ["oserror", "safetensors"])
def test_a_full_disk_during_a_merged_export_is_one_line_and_leaves_no_folder(finished_run, tmp_path, monkeypatch,
                                                                            capsys, writer):
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        _no_space if writer == "oserror" else _no_space_in_safetensors)
    out = tmp_path / "merged"
    assert cli.main(["export", str(finished_run), "--format", "merged", "--output_dir", str(out)]) == 2
    err = one_line_error(capsys)
    assert f"xgblora export: error: could not export {out} (" in err and "No space left on device" in err
    assert "; it needs about " in err and " are free on that disk. Nothing was written under that name" in err
    assert list(tmp_path.iterdir()) == []  # no .merged.tmp either


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
def test_a_full_disk_during_a_gguf_export_is_one_line_and_leaves_no_file(finished_run, tmp_path, monkeypatch, capsys):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", _no_space)  # after its header: a part-file
    out = tmp_path / "model.gguf"
    assert cli.main(["export", str(finished_run), "--format", "gguf", "--output_file", str(out)]) == 2
    err = one_line_error(capsys)
    assert f"could not export {out} (OSError: [Errno 28] No space left on device); it needs about " in err
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary folder
    monkeypatch.undo()
    assert cli.main(["export", str(finished_run), "--format", "gguf", "--output_file", str(out)]) == 0
    assert out.is_file()
