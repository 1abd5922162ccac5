"""A run folder knows its state: the same command run again on an interrupted run refuses (naming its last
checkpoint and the two ways on) and changes nothing (after a SIGKILL: test_robustness); resuming a finished run does
nothing; starting over removes the earlier run's checkpoints; an evaluation never writes over an earlier
results.json."""

from __future__ import annotations

import json

import pytest
from helpers import interrupt_at, killed_at_step, make_cfg, snapshot

from xgblora import checkpoint, cli
from xgblora.recipes import sft


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_rerun_after_ctrl_c_refuses_and_starting_over_removes_the_earlier_checkpoints(glue_data, tmp_path,
                                                                                        capsys):
    out = tmp_path / "run"
    cfg = make_cfg(glue_data, out, max_steps=8, save_steps=3, no_eval=True)
    with pytest.raises(KeyboardInterrupt, match="stopped at step 7"):
        sft.run(cfg, hooks=interrupt_at(7))
    before, _ = snapshot(out), capsys.readouterr()
    args = ["train", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data),
            "--num_train", "64", "--num_eval", "16", "--method", "lora", "--max_steps", "8", "--save_steps", "3",
            "--max_length", "64", "--output_dir", str(out), "--device", "cpu", "--no_eval"]
    assert cli.main(args) == 2
    assert "holds an interrupted run (last checkpoint" in one_line_error(capsys)
    assert snapshot(out) == before

    # started over and stopped before the old run's step-7: 'latest' must not find the old run's checkpoint
    with pytest.raises(KeyboardInterrupt, match="stopped at step 4"):
        sft.run(make_cfg(glue_data, out, max_steps=8, save_steps=3, no_eval=True, overwrite_output_dir=True),
                  hooks=interrupt_at(4))
    assert [p.name for p in checkpoint.step_checkpoints(out / "checkpoints")] == ["step-3", "step-4"]


def test_resuming_a_finished_run_says_so_and_changes_nothing(glue_data, tmp_path, capsys):
    out = tmp_path / "run"
    results = sft.run(make_cfg(glue_data, out, max_steps=4, save_steps=2, no_eval=True))
    capsys.readouterr()
    before = snapshot(out)
    again = sft.run(make_cfg(glue_data, out, max_steps=4, save_steps=2, no_eval=True,
                               resume_from_checkpoint="latest"))
    assert again == json.loads(json.dumps(results))
    assert snapshot(out) == before
    assert "holds a finished run (results.json): nothing to resume" in capsys.readouterr().err


def test_eval_never_writes_over_an_earlier_results_json(glue_data, tmp_path, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "results.json").write_text('{"mine": 1}\n')
    args = ["eval", "--model_name", "tiny-opt", "--task_name", "SST2", "--data_dir", str(glue_data),
            "--num_eval", "8", "--output_dir", str(out)]
    assert cli.main(args) == 2
    err = one_line_error(capsys)
    assert "already holds a finished run's results.json" in err and "--overwrite_output_dir" in err
    assert "trainable" not in err and sorted(p.name for p in out.iterdir()) == ["results.json"]
    assert (out / "results.json").read_text() == '{"mine": 1}\n'
    assert cli.main([*args, "--overwrite_output_dir"]) == 0
    assert "accuracy" in json.loads((out / "results.json").read_text())


def _grpo_and_dpo_files(folder) -> dict[str, list[str]]:
    """The flags of a tiny grpo and dpo run on files of their own rows."""
    questions = [{"prompt": f"{a}+{a}=", "completion": f"#### {2 * a}"} for a in range(1, 9)]
    pairs = [{"prompt": f"{a}+{a}=", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"} for a in range(1, 9)]
    for name, rows in (("q.jsonl", questions), ("p.jsonl", pairs)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model_name", "tiny-llama", "--max_steps", "4", "--save_steps", "1", "--device", "cpu"]
    return {"grpo": ["grpo", "--train_file", str(folder / "q.jsonl"), "--num_generations", "2",
                     "--per_device_train_batch_size", "4", "--max_new_tokens", "4", *common],
            "dpo": ["dpo", "--train_file", str(folder / "p.jsonl"), "--per_device_train_batch_size", "4", *common]}


@pytest.mark.parametrize("command", ["grpo", "dpo"])
def test_grpo_and_dpo_reruns_refuse_an_interrupted_run(tmp_path, capsys, monkeypatch, command):
    """grpo and dpo share train's run folder: the same command on an interrupted run refuses in one line and changes
    nothing; --resume_from_checkpoint latest finishes it."""
    args = [*_grpo_and_dpo_files(tmp_path)[command], "--output_dir", str(tmp_path / "run")]
    with killed_at_step(monkeypatch, 3):
        assert cli.main(args) == 130
    before, _ = snapshot(tmp_path / "run"), capsys.readouterr()
    assert cli.main(args) == 2
    assert "holds an interrupted run (last checkpoint" in one_line_error(capsys)
    assert any(name.startswith("checkpoints/step-2/") for name in before)
    assert snapshot(tmp_path / "run") == before
    assert cli.main([*args, "--resume_from_checkpoint", "latest"]) == 0
    assert json.loads((tmp_path / "run" / "results.json").read_text())["resumes"] == 1


@pytest.mark.parametrize("longer", [["--max_steps", "6"], ["--max_steps", "-1", "--num_train_epochs", "3"]])
def test_resuming_a_finished_run_for_longer_refuses_with_the_way_on_and_that_way_works(tmp_path, capsys, longer):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}", "completion": w}) + "\n" for w in ["yes", "no"] * 4))
    common = ["train", "--model_name", "tiny-llama-chat", "--task_name", "custom", "--train_file", str(data),
              "--method", "lora", "--per_device_train_batch_size", "4", "--device", "cpu", "--no_eval"]
    out = tmp_path / "run"
    first = ["--max_steps", "4"] if longer[1] == "6" else ["--max_steps", "-1", "--num_train_epochs", "2"]
    assert cli.main([*common, *first, "--output_dir", str(out)]) == 0
    capsys.readouterr()
    before = snapshot(out)
    assert cli.main([*common, *longer, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]) == 2
    error = one_line_error(capsys)
    assert "holds a finished run of 4 steps" in error and f"--model_name {out} --output_dir" in error
    assert snapshot(out) == before
    assert cli.main([*common, "--max_steps", "2", "--model_name", str(out), "--output_dir", str(tmp_path / "more")]) == 0
