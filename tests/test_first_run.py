"""A user's first run: bad input, flags and paths fail fast (one line, exit 2, before any model loads, nothing left
behind), and the defaults of the user's own data (every row, no dev split unless asked)."""

import json
import re
import sys
import time
from pathlib import Path

import pytest

from xgblora import cli
from xgblora.evaluation.answers import make_extractor
from xgblora.models import pretrained


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the errors below must come before one."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(pretrained, "load", refuse)


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    chat = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"#### {i}"}]}
            for i in range(6)]
    _jsonl(tmp_path / "chat.jsonl", chat)
    _jsonl(tmp_path / "reviews.jsonl", [{"review": "good", "label": 1}, {"review": "bad", "label": 0}])
    _jsonl(tmp_path / "no_answer.jsonl", [{"prompt": "q"}])
    _jsonl(tmp_path / "pairs.jsonl", [{"query": f"q{i}", "positive": f"p{i}"} for i in range(4)])
    (tmp_path / "blocker").write_text("a file", encoding="utf-8")
    return tmp_path


CLS = ["--task_name", "custom", "--template", "{text} It was", "--label_words", "bad,good"]
CASES = {
    "missing train file": (["train", "--task_name", "custom", "--train_file", "nope.jsonl"],
                           "nope.jsonl: no such file"),
    "column not mapped": (["train", *CLS, "--train_file", "reviews.jsonl"],
                          r'reviews\.jsonl:1: field "text": missing; the row has: review, label '
                          r"\(--columns text=YOURS maps your column to it\)"),
    "bad --columns": (["train", "--task_name", "custom", "--train_file", "chat.jsonl", "--columns", "prompt"],
                      "--columns 'prompt': 'prompt' is not OURS=THEIRS"),
    "output_dir under a file": (["train", "--task_name", "custom", "--train_file", "chat.jsonl", "--output_dir",
                                 "blocker/run"], "--output_dir blocker/run: blocker is a file, not a folder"),
    "max_steps 0": (["train", "--max_steps", "0"], r"--max_steps must be positive \(or -1"),
    "max_steps -5": (["train", "--max_steps", "-5"], r"--max_steps must be positive"),
    "epochs 0": (["train", "--num_train_epochs", "0"], "--num_train_epochs must be positive"),
    "no such model folder": (["train", "--task_name", "custom", "--train_file", "chat.jsonl", "--model_name",
                              "./models/mine"], "cannot load model './models/mine': no such folder"),
    "uncached hub id offline": (["train", "--task_name", "custom", "--train_file", "chat.jsonl", "--model_name",
                                 "someone/not-cached-model"],
                                "not in the Hugging Face cache .* HF_HUB_OFFLINE is set"),
    "steps without any evaluation set": (["train", "--task_name", "custom", "--train_file", "chat.jsonl",
                                          "--evaluation_strategy", "steps"],
                                         "--evaluation_strategy steps needs a dev split.* --eval_split_ratio R"),
    "rft reference missing": (["rft", "--train_file", "no_answer.jsonl", "--eval_file", "chat.jsonl",
                               "--model_name", "tiny-llama-chat"], "no_answer.jsonl:1: no reference answer"),
    "rft verifier not importable": (["rft", "--train_file", "chat.jsonl", "--eval_file", "chat.jsonl",
                                     "--verifier", "nomod:fn"], "--verifier nomod:fn: cannot import it"),
    "rft output_root under a file": (["rft", "--train_file", "chat.jsonl", "--eval_file", "chat.jsonl",
                                      "--output_root", "blocker/x"], "--output_root blocker/x: blocker is a file"),
    "generate column not mapped": (["generate", "--input_file", "reviews.jsonl"],
                                   'field "prompt": missing.*the row has: review, label'),
    "generate output under a file": (["generate", "--input_file", "chat.jsonl", "--output_file", "blocker/o.jsonl"],
                                     "--output_file blocker: blocker is a file"),
    "grit without its instruction file": (["train", "--objective", "grit", "--train_file", "pairs.jsonl"],
                                          "--objective grit needs --grit_train_file"),
    "grit instruction file missing": (["train", "--objective", "grit", "--train_file", "pairs.jsonl",
                                       "--grit_train_file", "nope.jsonl"], "nope.jsonl: no such file"),
    "grit file without grit": (["train", "--objective", "contrastive", "--train_file", "pairs.jsonl",
                                "--grit_train_file", "chat.jsonl"], "--grit_train_file feeds GRIT's generative loss"),
    "chat template missing": (["train", "--task_name", "custom", "--train_file", "chat.jsonl", "--chat_template",
                               "nope.jinja"], "--chat_template nope.jinja: cannot read"),
    "generate chat template missing": (["generate", "--input_file", "chat.jsonl", "--chat_template", "nope.jinja"],
                                       "--chat_template nope.jinja: cannot read"),
    "encode column missing": (["encode", "tiny-bert", "--input_file", "reviews.jsonl", "--output_file", "v.npy"],
                              r'field "text": missing; the row has: review, label \(--column NAME'),
    "encode device unknown": (["encode", "tiny-bert", "--input_file", "reviews.jsonl", "--column", "review",
                               "--output_file", "v.npy", "--device", "gpu"], r"--device 'gpu': choose cpu, cuda"),
    "encode output under a file": (["encode", "tiny-bert", "--input_file", "reviews.jsonl", "--column", "review",
                                    "--output_file", "blocker/v.npy"], "--output_file blocker: blocker is a file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_fast_in_one_line_and_leaves_nothing(case, files, no_model, capsys):
    argv, message = CASES[case]
    before = sorted(p.name for p in files.rglob("*"))
    started = time.perf_counter()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"xgblora {argv[0]}: error: ")
    assert re.search(message, lines[0]), lines[0]
    assert sorted(p.name for p in files.rglob("*")) == before  # no output folder, file or round-0/ left
    assert time.perf_counter() - started < 30  # no hub retries


@pytest.mark.parametrize(("source", "message"), [
    ("import sys\nsys.exit(3)\n", r"importing {m} called sys\.exit\(3\); a module of functions must not exit "
                                   r"while it is imported \(put a script's code under if __name__ == '__main__':\)"),
    ("raise SystemExit\n", r"importing {m} called sys\.exit\(None\); .*"),
    ("x = 1 / 0\n", r"importing {m} failed \(ZeroDivisionError: division by zero\)"),
], ids=["sys.exit(3)", "bare SystemExit", "exception"])
def test_a_reward_module_that_fails_while_imported_is_one_line_naming_it(source, message, files, no_model, capsys,
                                                                          monkeypatch, request):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ left beside it
    module = "rewards_" + re.sub(r"\W", "_", request.node.callspec.id)  # imports are cached: a module per case
    (files / f"{module}.py").write_text(source, encoding="utf-8")
    before = sorted(p.name for p in files.rglob("*"))
    assert cli.main(["grpo", "--train_file", "chat.jsonl", "--reward_funcs", f"{module}:score", "--output_dir",
                     "run"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(rf"xgblora grpo: error: --reward_funcs {module}:score: "
                                            + message.format(m=module), lines[0]), lines
    assert sorted(p.name for p in files.rglob("*")) == before


def test_a_user_function_that_exits_is_one_line_naming_it():
    from xgblora import usercode

    def leaves(*args, **kwargs):
        raise SystemExit(4)
    with pytest.raises(usercode.UserCodeError, match=r"^reward function my:f called sys\.exit\(4\)$"):
        usercode.call("reward function my:f", leaves, completions=["a"])


def test_verifier_module_imports_from_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_checks.py").write_text("def last_word(text):\n    return text.split()[-1]\n", encoding="utf-8")
    assert make_extractor("my_checks:last_word")("the answer is 42") == "42"


def test_a_run_that_fails_after_creating_its_folder_removes_it(files, monkeypatch, capsys):
    """The folder is made before the model loads; when loading fails, the empty folder goes with the run."""
    def broken(*args, **kwargs):
        from xgblora.errors import UserError
        raise UserError("cannot load model 'x': broken")
    monkeypatch.setattr(pretrained, "load", broken)
    assert cli.main(["train", "--task_name", "custom", "--train_file", "chat.jsonl", "--output_dir", "a/b/run"]) == 2
    assert not (files / "a").exists()


def test_only_train_option_false_puts_the_loss_on_every_token_as_hf_does():
    """MeZO's --only_train_option false: the loss of an example is HF's causal LM loss over its whole sequence."""
    import torch

    from xgblora.data.tasks import Example
    from xgblora.train.objective import causal_training_set, per_example_loss

    model, tokenizer = pretrained.random_model("tiny-llama", seed=1)
    example = Example("The film was a joy to watch. It was", (" terrible", " great"), (1,))
    whole = causal_training_set(tokenizer, [example], 64, False, whole_sequence=True).batch([0])
    gold_only = causal_training_set(tokenizer, [example], 64, False).batch([0])
    ids = whole.input_ids[whole.attention_mask.bool()].unsqueeze(0)
    with torch.no_grad():
        reference = model(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(per_example_loss(model, whole)[0], reference, rtol=1e-5, atol=1e-6)
        assert not torch.isclose(per_example_loss(model, gold_only)[0], reference)


def test_only_train_option_false_is_refused_where_it_has_no_meaning():
    from xgblora.config import Config
    from xgblora.errors import UserError

    with pytest.raises(UserError, match="--only_train_option false"):
        Config(task_name="SST2", only_train_option=False, train_as_classification=True)
    assert Config(task_name="SST2", only_train_option=False).only_train_option is False


@pytest.mark.parametrize("method", ["lora", pytest.param("xgblora", marks=pytest.mark.slow)])
def test_train_eval_generate_export_and_load_in_peft(method, files, capsys):
    """The after-training chain as a user types it: train -> eval --adapter RUN/final (also on a 4-bit base) ->
    generate --adapter -> export --format peft -> PEFT loads the adapter with its own tokenizer and chat template and
    gives xgblora's logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from xgblora.adapters.trained import load_for_inference

    run = files / "run"
    assert cli.main(["train", "--model_name", "tiny-llama-chat", "--task_name", "custom", "--train_file", "chat.jsonl",
                     "--method", method, "--learning_rate", "1e-2", "--max_steps", "4", "--output_dir", str(run),
                     "--max_new_tokens", "4"]) == 0
    capsys.readouterr()
    for extra in ([], ["--load_in_4bit"]):
        out = files / f"eval{len(extra)}"
        assert cli.main(["eval", "--model_name", "tiny-llama-chat", "--adapter", str(run / "final"), "--task_name",
                         "custom", "--eval_file", "chat.jsonl", "--max_new_tokens", "4", "--output_dir", str(out),
                         *extra]) == 0, capsys.readouterr().err
        assert json.loads((out / "results.json").read_text())["num_eval"] == 6
    assert cli.main(["generate", "--model_name", "tiny-llama-chat", "--adapter", str(run / "final"), "--input_file",
                     "chat.jsonl", "--output_file", "gen.jsonl", "--max_new_tokens", "4"]) == 0
    assert len((files / "gen.jsonl").read_text().splitlines()) == 6
    assert cli.main(["export", str(run), "--format", "peft", "--output_dir", str(files / "peft")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(files / "peft")
    assert tokenizer.chat_template and tokenizer.chat_template == AutoTokenizer.from_pretrained(run / "final").chat_template
    base, _ = pretrained.random_model("tiny-llama-chat")
    peft_model = PeftModel.from_pretrained(base, files / "peft").eval()
    ours, _ = load_for_inference(str(run))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "q1"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    card = (run / "final" / "README.md").read_text()
    assert "load_for_inference" in card and "AutoPeftModel" not in card  # a built-in base is not on the hub


@pytest.mark.parametrize("method", ["ft", "lora"])
def test_train_eval_generate_export_merged_and_load_in_transformers(method, files, capsys):
    """The chain for a merged model, full fine-tuning's only export: train -> eval --adapter RUN/final ->
    generate --adapter -> export --format merged -> plain transformers loads the folder (model and tokenizer) and
    gives xgblora's logits; a PEFT export of a full run is refused with the way out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xgblora.adapters.trained import load_for_inference

    run = files / "run"
    assert cli.main(["train", "--model_name", "tiny-llama-chat", "--task_name", "custom", "--train_file", "chat.jsonl",
                     "--method", method, "--learning_rate", "1e-2", "--max_steps", "4", "--output_dir", str(run),
                     "--max_new_tokens", "4"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", "--model_name", "tiny-llama-chat", "--adapter", str(run / "final"), "--task_name",
                     "custom", "--eval_file", "chat.jsonl", "--max_new_tokens", "4", "--output_dir",
                     str(files / "eval")]) == 0, capsys.readouterr().err
    assert json.loads((files / "eval" / "results.json").read_text())["num_eval"] == 6
    assert cli.main(["generate", "--model_name", "tiny-llama-chat", "--adapter", str(run / "final"), "--input_file",
                     "chat.jsonl", "--output_file", "gen.jsonl", "--max_new_tokens", "4"]) == 0
    assert len((files / "gen.jsonl").read_text().splitlines()) == 6
    if method == "ft":
        capsys.readouterr()
        assert cli.main(["export", str(run), "--format", "peft", "--output_dir", str(files / "peft")]) == 2
        assert "use --format merged" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--format", "merged", "--output_dir", str(files / "merged")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(files / "merged")
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(run / "final").chat_template
    merged = AutoModelForCausalLM.from_pretrained(files / "merged").eval()
    ours, _ = load_for_inference(str(run))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "q1"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        trained = ours(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=1e-4, atol=1e-5)
        base, _ = pretrained.random_model("tiny-llama-chat")
        assert not torch.allclose(base(input_ids=ids).logits, trained, atol=1e-4)  # the training is in it


def test_warnings_are_one_plain_line_and_library_renames_are_silenced(monkeypatch):
    import warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    cli.plain_warnings()
    assert warnings.formatwarning("2 of 3 prompts were longer", UserWarning, "/x/evaluate.py", 75) == \
        "xgblora: warning: 2 of 3 prompts were longer\n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit("`past_key_values` is deprecated", FutureWarning, "module.py", 1,
                               module="torch.nn.modules.module")
        warnings.warn_explicit("yours", UserWarning, "evaluate.py", 1, module="xgblora.evaluation.candidates")
    assert [str(w.message) for w in caught] == ["yours"]


@pytest.mark.parametrize(("command", "flag", "default"), [
    ("train", "--trainer", "regular"), ("eval", "--num_train", "0"), ("mezo", "--trainer", "none"),
    ("mezo", "--result_file", "auto"), ("rft", "--method", "lora"), ("train", "--method", "ft"),
    ("encode", "--batch_size", "32"), ("demo", "--steps", None)])
def test_help_shows_each_commands_own_default(command, flag, default, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    entries, lines = [], capsys.readouterr().out.split("options:", 1)[1].splitlines()
    for line in lines:  # one entry per flag: its first line starts with two spaces and a dash
        if line.startswith("  -"):
            entries.append(line)
        elif entries and line.startswith("   "):  # the entry's help goes on (a section's title and text do not)
            entries[-1] += " " + line.strip()
    (entry,) = [e for e in entries if flag in e.split()[0].rstrip(",").split(",") or e.split()[0].rstrip(",") == flag]
    entry = " ".join(entry.split())
    assert f"(default: {default})" in entry if default is not None else "(default: " in entry, entry
