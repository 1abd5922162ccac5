"""Flag parsing with MeZO's names, YAML configs, precedence, validation messages."""

import dataclasses
import shlex

import pytest
import yaml

from xgblora import cli, parsing
from xgblora.config import Config

SEED_003 = """--model_name facebook/opt-350m --task_name SST2 --xgblora --xgblora_steps_per_iteration 1000 --trainer zo
--learning_rate 1e-5 --zo_eps 1e-3 --per_device_train_batch_size 16 --max_steps 20000 --num_train 1000 --num_dev 500
--num_eval 1000 --load_float16 --output_dir ./output --evaluation_strategy steps --eval_steps 4000 --save_steps 4000
--logging_steps 10"""
SEED_000 = r"""--output_root E:\aOutput\MultiRC\test_200_re --loss_figure_path E:\aOutput\MultiRC\test_200_re\loss.png
--model_name facebook/opt-350m --task_name MultiRC --learning_rate 1e-5 --zo_eps 1e-3 --max_steps 2000
--xgblora_steps_per_iteration 200 --eval_steps 100 --num_train 2000 --num_dev 500 --num_eval 1000 --seeds 0
--lora_rank 1 --lora_alpha 16"""



def parse(command: str, argv: list[str]) -> Config:
    """The command line as `xgblora COMMAND` reads it: its parser, then its options resolved."""
    args = cli.build_parser().parse_args([command, *argv])
    return parsing.from_namespace(cli.COMMANDS[command].options, args, cli.COMMANDS[command].defaults)

def test_seed_run_py_command_line_parses_verbatim():
    cfg = parse("train", shlex.split(SEED_003))
    assert (cfg.method, cfg.rank, cfg.trainer, cfg.load_float16, cfg.dtype_name) == ("xgblora", 1, "zo", True, "float16")
    assert (cfg.num_train, cfg.num_dev, cfg.num_eval, cfg.eval_steps, cfg.evaluation_strategy) == (1000, 500, 1000, 4000, "steps")
    assert cfg.learning_rate == 1e-5 and cfg.per_device_train_batch_size == 16 and cfg.max_steps == 20000


def test_seed_compare_command_line_parses_verbatim():
    cfg = parse("compare", shlex.split(SEED_000, posix=False))
    assert cfg.seeds == [0] and cfg.lora_r == 1 and cfg.lora_alpha == 16.0 and cfg.task_name == "MultiRC"
    assert cfg.loss_figure_path.endswith("loss.png") and cfg.methods == ["xgblora", "lora"]


def test_hyphenated_spelling_and_bool_values():
    a = parse("train", ["--model-name", "tiny-llama", "--num-train", "3", "--trainer", "zo", "--zo-dual", "false",
                               "--lora"])
    assert (a.model_name, a.num_train, a.zo_dual, a.method, a.rank) == ("tiny-llama", 3, False, "lora", 8)
    assert parse("train", ["--zo_stochastic_rounding", "none"]).zo_stochastic_rounding is None
    with pytest.raises(SystemExit):
        parse("train", ["--zo_dual", "maybe"])


def test_yaml_then_command_line_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task_name: RTE\nlearning_rate: 1.0e-4\nnum-train: 7\nmethod: lora\nlora_rank: 4\n")
    cfg = parse("train", ["--config", str(path), "--task_name", "CB"])
    assert (cfg.task_name, cfg.learning_rate, cfg.num_train, cfg.lora_r) == ("CB", 1e-4, 7, 4)


def test_dumped_config_reloads_identically(tmp_path):
    cfg = parse("compare", ["--xgblora", "--seeds", "1", "2", "--xgblora_layers_per_booster", "2"])
    parsing.dump(cfg, tmp_path / "config.yaml")
    again = parse("compare", ["--config", str(tmp_path / "config.yaml")])
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


# malformed YAML and incompatible flags: test_malformed_inputs.py


def test_yaml_file_is_plain_mapping_of_every_option(tmp_path):
    parsing.dump(Config(), tmp_path / "c.yaml")
    data = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert set(data) == {f.name for f in dataclasses.fields(Config)}
