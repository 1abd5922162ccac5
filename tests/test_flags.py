"""Every flag a command accepts does something: one it would ignore is refused in one line before any model loads,
and every command's defaults pass."""

import argparse
import dataclasses
import re

import pytest

from xgblora import cli
from xgblora import config as config_mod
from xgblora.models import pretrained


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")
    monkeypatch.setattr(pretrained, "load", refuse)


RFT = ["rft", "--train_file", "q.jsonl", "--eval_file", "q.jsonl"]
GRPO = ["grpo", "--train_file", "q.jsonl"]
# argv -> the flag the refusal names
REFUSED = {
    "eval learning rate": (["eval", "--learning_rate", "1e-3"], "learning_rate"),
    "eval optimiser": (["eval", "--adam_beta1", "0.8"], "adam_beta1"),
    "eval save strategy": (["eval", "--save_strategy", "no"], "save_strategy"),
    "eval evaluation strategy": (["eval", "--evaluation_strategy", "steps"], "evaluation_strategy"),
    "eval boosting": (["eval", "--xgblora_num_boosters", "3"], "xgblora_num_boosters"),
    "eval method": (["eval", "--method", "lora"], "method"),
    "eval ZO": (["eval", "--zo_eps", "1e-2"], "zo_eps"),
    "eval no_eval": (["eval", "--no_eval"], "no_eval"),
    "mezo zero-shot with --lora": (["mezo", "--lora"], "lora"),
    "train none resume": (["train", "--trainer", "none", "--resume_from_checkpoint", "latest"],
                          "resume_from_checkpoint"),
    "regular ZO estimator": (["train", "--zo_estimator", "fzoo"], "zo_estimator"),
    "regular head trainer": (["train", "--head_trainer", "frozen"], "head_trainer"),
    "zo clipping": (["train", "--trainer", "zo", "--max_grad_norm", "0.5"], "max_grad_norm"),
    "zo sgd momentum": (["train", "--trainer", "zo", "--adam_beta1", "0.8"], "adam_beta1"),
    "ft LoRA rank": (["train", "--lora_r", "4"], "lora_r"),
    "ft rsLoRA": (["train", "--use_rslora"], "use_rslora"),
    "lora boosters": (["train", "--method", "lora", "--xgblora_steps_per_iteration", "5"],
                      "xgblora_steps_per_iteration"),
    "adaptive without --xgblora_adaptive": (["train", "--xgblora", "--xgblora_adaptive_patience", "5"],
                                             "xgblora_adaptive_patience"),
    "lm pooling prompt": (["train", "--include_prompt", "false"], "include_prompt"),
    "lm query instruction": (["train", "--query_instruction", "query: "], "query_instruction"),
    "lm temperature": (["train", "--temperature", "0.1"], "contrastive_temperature"),
    "contrastive GRIT weight": (["train", "--objective", "contrastive", "--train_file", "p.jsonl",
                                 "--grit_generative_weight", "2"], "grit_generative_weight"),
    "contrastive label words": (["train", "--objective", "contrastive", "--train_file", "p.jsonl",
                                 "--label_words", "a,b"], "label_words"),
    "compare seed": (["compare", "--seed", "3"], "seed"),
    "compare output_dir": (["compare", "--output_dir", "x"], "output_dir"),
    "compare ZO flag with regular runs": (["compare", "--methods", "lora:regular", "--zo_eps", "1e-2"], "zo_eps"),
    "compare LoRA flag with ft runs": (["compare", "--methods", "ft", "--lora_alpha", "4"], "lora_alpha"),
    "rft ZO flag": ([*RFT, "--zo_eps", "1e-2"], "zo_eps"),
    "grpo boosters under lora": ([*GRPO, "--xgblora_shrinkage", "0.5"], "xgblora_shrinkage"),
    "chat several replies": (["chat", "--num_return_sequences", "2", "--temperature", "1"], "num_return_sequences"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_ignored_flag_is_refused_in_one_line_naming_it(case, no_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv, flag = REFUSED[case]
    assert cli.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert re.match(rf"xgblora {argv[0]}: error: --{flag} .* does nothing here: .+", lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["rft", "grpo"])
def test_flags_rft_and_grpo_never_read_are_not_theirs(command, no_model, tmp_path, monkeypatch, capsys):
    """Left out of the parser: the flag is unknown, and a YAML config (a dumped one names every option) may carry it
    only at its default."""
    monkeypatch.chdir(tmp_path)
    argv = RFT if command == "rft" else GRPO
    assert cli.main([*argv, "--label_words", "a,b"]) == 2
    assert "unrecognized arguments: --label_words" in capsys.readouterr().err
    assert "--pooling" not in cli.build_parser()._subparsers._group_actions[0].choices[command].format_help()
    (tmp_path / "c.yaml").write_text("pooling: auto\nobjective: contrastive\n")
    assert cli.main([*argv, "--config", "c.yaml"]) == 2
    assert re.search(rf"xgblora {command}: error: --objective 'contrastive' does nothing here",
                     capsys.readouterr().err)


# the files a command cannot run without (never read here: the check comes first)
REQUIRED = {"generate": {"input_file": "p.jsonl"}, "rft": {"train_file": "q.jsonl", "eval_file": "q.jsonl"},
            "grpo": {"train_file": "q.jsonl"}, "dpo": {"train_file": "q.jsonl"}}


@pytest.mark.parametrize("command", [name for name, c in cli.COMMANDS.items() if c.options])
def test_every_commands_defaults_pass(command):
    """Nothing given but a command's required files: no refusal; its dumped config (every option) passes too."""
    cls, defaults, required = cli.COMMANDS[command].options, cli.COMMANDS[command].defaults, REQUIRED.get(command, {})
    cfg = config_mod.from_namespace(cls, argparse.Namespace(**required), defaults)
    config_mod.check_ignored(cls(**dataclasses.asdict(cfg)), defaults)
