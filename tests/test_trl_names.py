"""TRL's config names in a YAML config: the static table (trl_names.py) against the installed TRL's dataclasses and
docs/trl.md, and what each kind of key does: mapped onto xgblora's option, ignored with a warning, refused."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from xgblora import cli, parsing, trl_names
from xgblora.config import Config, DPOConfig, GRPOConfig, KTOConfig, RewardConfig
from xgblora.errors import UserError

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"SFTConfig": Config, "DPOConfig": DPOConfig, "GRPOConfig": GRPOConfig, "KTOConfig": KTOConfig,
            "RLOOConfig": GRPOConfig, "RewardConfig": RewardConfig}


def _xgblora_names(cls: type) -> set[str]:
    return {name for f in dataclasses.fields(cls) for name in (f.name, *parsing._aliases(cls, f))}


@pytest.fixture(scope="module")
def trl_fields():
    """Each TRL config's fields (transformers' TrainingArguments among them), from the installed TRL."""
    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    classes = {"SFTConfig": trl.SFTConfig, "DPOConfig": trl.DPOConfig, "GRPOConfig": trl.GRPOConfig,
               "KTOConfig": trl.KTOConfig, "RLOOConfig": trl.RLOOConfig, "RewardConfig": trl.RewardConfig}
    assert all(issubclass(c, transformers.TrainingArguments) for c in classes.values())
    training = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return {name: {f.name for f in dataclasses.fields(c)} for name, c in classes.items()}, training


@pytest.mark.parametrize("trl_config", list(COMMANDS))
def test_every_trl_field_is_an_xgblora_name_or_in_the_table(trl_fields, trl_config):
    """A TRL field is one of xgblora's names (or aliases), or the table maps, ignores or refuses it; the table names
    no field TRL lacks, its mapped options are the command's, and it overrides an xgblora name only to map it."""
    fields, _ = trl_fields
    cls, table = COMMANDS[trl_config], trl_names.TABLES[trl_config]
    ours = _xgblora_names(cls)
    assert sorted(fields[trl_config] - ours - table.keys()) == []
    assert sorted(table.keys() - fields[trl_config]) == []
    for name, entry in table.items():
        if isinstance(entry, trl_names.Mapped):
            assert set(entry.options) <= {f.name for f in dataclasses.fields(cls)}, name
        else:
            assert name not in ours, name
    assert trl_names.table_for(cls).items() >= table.items()  # grpo's GRPOConfig table holds RLOOConfig's


def test_training_arguments_entries_are_training_arguments_fields(trl_fields):
    _, training = trl_fields
    assert sorted(trl_names.COMMON.keys() - training) == []


def test_the_docs_name_every_key_of_the_table():
    page = (REPO / "docs" / "trl.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(\w+)`", page))
    keys = {name for table in trl_names.TABLES.values() for name in table}
    assert sorted(keys - named) == []
    for doc in ("chat-sft.md", "dpo.md", "grpo.md", "reward.md"):  # dpo.md's KTO section too
        assert "(trl.md)" in (REPO / "docs" / doc).read_text(encoding="utf-8"), doc


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "trl.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_trl_sft_yaml_runs(tmp_path):
    """SFTConfig's loss and dataset names run `xgblora train --config`: the text field is read under its name."""
    rows = [{"body": f"{a} plus {a} is {2 * a}"} for a in range(6)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = _yaml(tmp_path, "model_name: tiny-llama\ntask_name: custom\ntrain_file: rows.jsonl\n"
                             "dataset_text_field: body\ncompletion_only_loss: true\nassistant_only_loss: true\n"
                             "per_device_train_batch_size: 2\nmax_steps: 2\nlearning_rate: 1.0e-4\n"
                             "max_length: 64\nsave_strategy: 'no'\n"
                             f"output_dir: {tmp_path / 'run'}\n")
    assert cli.main(["train", "--config", config]) == 0
    saved = (tmp_path / "run" / "config.yaml").read_text(encoding="utf-8")
    assert "columns: text=body" in saved and "train_on_prompt: false" in saved


@pytest.mark.parametrize(("cls", "text", "want"), [
    (Config, "completion_only_loss: false", {"train_on_prompt": True}),
    (Config, "completion_only_loss: null\nassistant_only_loss: true", {"train_on_prompt": False}),
    (Config, "dataset_text_field: text", {}),
    (Config, "padding_free: true\ntorch_compile: true\nuse_cpu: true",
     {"packing": True, "compile": True, "device": "cpu"}),
    (Config, "warmup_steps: 0.1\nreport_to: [tensorboard, mlflow]\nlr_scheduler_type: constant_with_warmup",
     {"warmup_ratio": 0.1, "report_to": "tensorboard,mlflow", "lr_scheduler_type": "constant"}),
    (Config, "warmup_steps: 10\noptim: adamw_torch\ntrain_sampling_strategy: group_by_length",
     {"warmup_steps": 10, "fused_adamw": False, "group_by_length": True}),
    (Config, "model_init_kwargs: {dtype: bfloat16, attn_implementation: sdpa}",
     {"load_bfloat16": True, "attn_implementation": "sdpa"}),
    (Config, "truncation_mode: keep_end\nloss_type: nll\nlabel_smoothing_factor: 0.0", {}),
    (KTOConfig, "loss_type: apo_zero_unpaired\ndesirable_weight: 1.33\ntrain_sampling_strategy: random\n"
                "model_init_kwargs: {dtype: float32}", {"loss_type": "apo_zero_unpaired", "desirable_weight": 1.33,
                                                        "group_by_length": False}),
    (DPOConfig, "disable_dropout: false\nf_divergence_type: reverse_kl\ntruncation_mode: keep_start",
     {"disable_dropout": False}),
    (GRPOConfig, "scale_rewards: false\nnum_generations: 4\nmax_completion_length: 32\nshuffle_dataset: true\n"
                 "top_k: 0\nrepetition_penalty: 1.0\nuse_vllm: false",
     {"scale_rewards": "none", "num_return_sequences": 4, "max_new_tokens": 32}),
    (GRPOConfig, "normalize_advantages: true\nreward_clip_range: [-1.0, 1.0]\nbeta: 0.05\nnum_generations: 2",
     {"normalize_advantages": True, "reward_clip_range": [-1.0, 1.0], "beta": 0.05, "num_return_sequences": 2}),
    (RewardConfig, "center_rewards_coefficient: 0.01\nchat_template_path: t.jinja\npad_to_multiple_of: null\n"
                   "dataset_num_proc: null\ndisable_dropout: true",
     {"center_rewards_coefficient": 0.01, "chat_template": "t.jinja", "disable_dropout": True}),
])
def test_trl_keys_map_onto_xgblora_options(tmp_path, xgblora_log, cls, text, want):
    assert parsing.read_yaml(cls, _yaml(tmp_path, text)) == want
    assert not [r for r in xgblora_log.records if r.name == "xgblora" and r.levelname == "WARNING"]


@pytest.mark.parametrize(("cls", "text", "message"), [
    (Config, "neftune_noise_alpha: 5", "adds no NEFTune noise"),
    (Config, "truncation_mode: keep_start", "from the left (keep_end)"),
    (Config, "assistant_only_loss: false", "train_on_prompt: true"),
    (Config, "optim: adafactor", "trains with AdamW"),
    (Config, "model_init_kwargs: {device_map: auto}", "device_map"),
    (Config, "deepspeed: ds.json", "torchrun or accelerate launch"),
    (Config, "completion_only_loss: true\nassistant_only_loss: false", "every token"),
    (Config, "completion_only_loss: false\ntrain_on_prompt: false", "keep one of them"),
    (Config, "label_names: [labels]", "builds its own batches"),
    (DPOConfig, "f_divergence_type: js_divergence", "reverse KL"),
    (DPOConfig, "sync_ref_model: true", "starting model"),
    (KTOConfig, "sync_ref_model: true", "starting model"),
    (KTOConfig, "train_sampling_strategy: sequential", "seeded random order"),
    (GRPOConfig, "use_vllm: true", "shared-prefix sampler"),
    (GRPOConfig, "top_k: 50", "temperature and top_p"),
    (GRPOConfig, "shuffle_dataset: false", "seeded random order"),
    (RewardConfig, "eos_token: <eot>", "special tokens"),
])
def test_trl_keys_that_would_change_training_are_refused(tmp_path, cls, text, message):
    with pytest.raises(UserError, match="TRL's") as error:
        parsing.read_yaml(cls, _yaml(tmp_path, text))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_refused_key_stops_the_command_with_exit_2(tmp_path, capsys):
    config = _yaml(tmp_path, "neftune_noise_alpha: 5\n")
    assert cli.main(["train", "--config", config, "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'neftune_noise_alpha' is TRL's" in err
    assert not (tmp_path / "run").exists()


def test_keys_that_change_nothing_trained_are_ignored_with_a_warning(tmp_path, xgblora_log):
    """One warning line per key, saying what xgblora does instead; none for a key left off (false, null)."""
    text = "push_to_hub: true\nhub_model_id: me/run\ndataloader_num_workers: 4\nlogging_first_step: false\n"
    assert parsing.read_yaml(Config, _yaml(tmp_path, text)) == {}
    warned = [r.getMessage() for r in xgblora_log.records if r.name == "xgblora" and r.levelname == "WARNING"]
    assert len(warned) == 3 and all("is TRL's and is ignored" in m for m in warned)
    assert re.search(r"'push_to_hub' .*output_dir only", warned[0])


def test_commands_without_a_trl_config_keep_unknown_keys_unknown(tmp_path):
    from xgblora.config import ChatConfig

    assert trl_names.table_for(ChatConfig) == {}
    with pytest.raises(UserError, match="unknown key 'push_to_hub'"):
        parsing.read_yaml(ChatConfig, _yaml(tmp_path, "push_to_hub: true"))
