"""Every flag a command accepts does something: one it would ignore is refused in one line before any model loads,
and every command's defaults pass."""

import argparse
import dataclasses
import re

import pytest

from xgblora import cli, parsing
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
    "lm temperature": (["train", "--contrastive_temperature", "0.1"], "contrastive_temperature"),
    "contrastive GRIT weight": (["train", "--objective", "contrastive", "--train_file", "p.jsonl",
                                 "--grit_generative_weight", "2"], "grit_generative_weight"),
    "contrastive label words": (["train", "--objective", "contrastive", "--train_file", "p.jsonl",
                                 "--label_words", "a,b"], "label_words"),
    "regular SVRG anchor rate": (["train", "--zo_svrg_anchor_learning_rate", "1e-3"], "zo_svrg_anchor_learning_rate"),
    "lm embedding pieces": (["train", "--embed_pieces", "true"], "embed_pieces"),
    "lm Matryoshka sizes": (["train", "--matryoshka_dims", "64,32"], "matryoshka_dims"),
    "contrastive packing": (["train", "--objective", "contrastive", "--train_file", "p.jsonl", "--packing", "true"],
                            "packing"),
    "contrastive logged samples": (["train", "--objective", "contrastive", "--train_file", "p.jsonl",
                                    "--log_samples", "3"], "log_samples"),
    "compare ZO flag with regular runs": (["compare", "--methods", "lora:regular", "--zo_eps", "1e-2"], "zo_eps"),
    "compare LoRA flag with ft runs": (["compare", "--methods", "ft", "--lora_alpha", "4"], "lora_alpha"),
    "rft ZO flag": ([*RFT, "--zo_eps", "1e-2"], "zo_eps"),
    "grpo boosters under lora": ([*GRPO, "--xgblora_shrinkage", "0.5"], "xgblora_shrinkage"),
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


# argv -> a flag of another command: not in the command's groups, so not one of its flags
NOT_THEIRS = {
    "eval learning rate": ["eval", "--learning_rate", "1e-3"],
    "eval optimiser": ["eval", "--adam_beta1", "0.8"],
    "eval save strategy": ["eval", "--save_strategy", "no"],
    "eval method": ["eval", "--method", "lora"],
    "eval trainer": ["eval", "--trainer", "zo"],
    "eval no_eval": ["eval", "--no_eval"],
    "compare seed": ["compare", "--seed", "3"],
    "train sampling temperature": ["train", "--temperature", "0.1"],
    "compare output_dir": ["compare", "--output_dir", "x"],
    "chat several replies": ["chat", "--temperature", "1", "--num_return_sequences", "2"],
    "rft label words": [*RFT, "--label_words", "a,b"],
    "grpo label words": [*GRPO, "--label_words", "a,b"],
    "dpo head": ["dpo", "--train_file", "q.jsonl", "--head", "classifier"],
}


@pytest.mark.parametrize("case", list(NOT_THEIRS))
def test_a_flag_the_command_never_reads_is_not_one_of_its_flags(case, no_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = NOT_THEIRS[case]
    assert cli.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"unrecognized arguments: {argv[-2] if argv[-1][0] != '-' else argv[-1]}" in lines[0]
    assert f"xgblora {argv[0]} never reads it (an option of xgblora " in lines[0]  # whose option it is
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["eval", "rft", "grpo"])
def test_a_yaml_config_may_name_another_commands_option_only_at_its_default(command, no_model, tmp_path, monkeypatch,
                                                                              capsys):
    """A dumped config.yaml names every option of its class: those outside the command pass at their default and
    are refused, in one line, at any other value."""
    monkeypatch.chdir(tmp_path)
    argv = {"eval": ["eval"], "rft": RFT, "grpo": GRPO}[command]
    assert "--pooling" not in cli.build_parser()._subparsers._group_actions[0].choices["grpo"].format_help()
    (tmp_path / "c.yaml").write_text("head_init: probe\nhead_trainer: zo\n")
    assert cli.main([*argv, "--config", "c.yaml"]) == 2
    assert re.search(rf"xgblora {command}: error: --head_trainer 'zo' does nothing here: xgblora {command} never "
                     rf"reads it", capsys.readouterr().err)


def test_eval_shows_at_most_53_flags_each_of_its_groups():
    """eval's parser holds the options of its groups only: the model, the rows, the task, the head, embeddings,
    retrieval (with --truncate_dim) and its reranker, numerics, the run's seed and folder, MeZO's result file."""
    parser = cli.build_parser()._subparsers._group_actions[0].choices["eval"]
    flags = {a.dest for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    assert len(flags) <= 53
    assert {"learning_rate", "method", "trainer", "save_steps", "zo_eps"}.isdisjoint(flags)
    assert {"model_name", "task_name", "num_train", "head", "objective", "per_device_eval_batch_size"} <= flags
    sections = [g.title for g in parser._action_groups]
    assert sections[2:] == [f"{g.__name__.removesuffix('Options')} options"
                            for g in config_mod.groups_of(config_mod.EvalConfig)]


def _parser_flags(command: str) -> set[str]:
    parser = cli.build_parser()._subparsers._group_actions[0].choices[command]
    return {a.dest for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}


@pytest.mark.parametrize("command", [name for name, c in cli.COMMANDS.items() if c.options])
def test_a_commands_class_holds_exactly_the_options_its_parser_shows(command):
    """What a command reads is what it takes: every field of its options class is one of its flags, and every flag
    one of its fields, so that no consumer can read an option the command's users cannot set."""
    fields = {f.name for f in dataclasses.fields(cli.COMMANDS[command].options)}
    assert _parser_flags(command) == fields


def test_no_commands_class_inherits_another_commands():
    """Commands share option groups and the bundles of config.py, never each other's class (mezo runs train's)."""
    classes = {c.options for c in cli.COMMANDS.values() if c.options}
    assert classes == set(config_mod.COMMAND_CLASSES)
    for cls in classes:
        assert [other.__name__ for other in classes - {cls} if issubclass(cls, other)] == [], cls.__name__


def test_no_options_dataclass_declares_over_30_fields_of_its_own():
    own = {cls.__name__: len(vars(cls).get("__annotations__", {}))
           for cls in (*config_mod.GROUPS, *config_mod.COMMAND_CLASSES, config_mod.TrainingOptions,
                       config_mod.TrainerConfig, config_mod.TaskTrainingOptions, config_mod.SamplerConfig)}
    assert max(own.values()) <= 30, own


def test_each_option_belongs_to_one_group_and_each_rule_names_real_options():
    """The grouping is declared once: no option in two groups; IGNORED names groups, or options of its groups'
    classes."""
    names = [f.name for group in config_mod.GROUPS for f in dataclasses.fields(group)]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    every = {f.name for cls in config_mod.COMMAND_CLASSES for f in dataclasses.fields(cls)}
    for rule in config_mod.IGNORED:
        assert rule.when in config_mod.GROUPS
        assert {o for o in rule.options if isinstance(o, str)} <= every
        assert all(o in config_mod.GROUPS for o in rule.options if isinstance(o, type))


# the files a command cannot run without (never read here: the check comes first)
REQUIRED = {"generate": {"input_file": "p.jsonl"}, "rft": {"train_file": "q.jsonl", "eval_file": "q.jsonl"},
            "grpo": {"train_file": "q.jsonl"}, "dpo": {"train_file": "q.jsonl"}, "kto": {"train_file": "q.jsonl"},
            "reward": {"train_file": "q.jsonl"}}


@pytest.mark.parametrize("command", [name for name, c in cli.COMMANDS.items() if c.options])
def test_every_commands_defaults_pass(command):
    """Nothing given but a command's required files: no refusal; its dumped config (every option) passes too."""
    cls, defaults, required = cli.COMMANDS[command].options, cli.COMMANDS[command].defaults, REQUIRED.get(command, {})
    cfg = parsing.from_namespace(cls, argparse.Namespace(**required, command=command), defaults)
    config_mod.check_ignored(cls(**dataclasses.asdict(cfg)), defaults)
