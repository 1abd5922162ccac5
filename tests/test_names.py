"""One meaning per name: a flag means the same in every command that takes it, an option is declared once, and no
two public classes of the package share a name (two `Objective`s read alike and do different things)."""

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

from xgblora import cli, parsing
from xgblora.config import COMMAND_CLASSES, DPOConfig, GRPOConfig
from xgblora.options import CompletionOptions, SamplingOptions

SRC = Path(__file__).resolve().parents[1] / "src" / "xgblora"


def _spellings(cls: type) -> dict[str, str]:
    """Every name a command takes for an option (its field names and their aliases) -> the option it sets."""
    return {name: f.name for f in dataclasses.fields(cls) for name in (f.name, *parsing._aliases(f))}


def test_temperature_is_the_sampling_temperature_in_every_command():
    """--temperature is the sampler's: a command that takes it samples (SamplingOptions) and no other option of any
    command answers to it (an embedding's is --contrastive_temperature)."""
    takers = [cls for cls in COMMAND_CLASSES if "temperature" in _spellings(cls)]
    assert {cls.__name__ for cls in takers} == {"ChatConfig", "GenerateConfig", "RFTConfig", "GRPOConfig"}
    for cls in takers:
        assert issubclass(cls, SamplingOptions) and _spellings(cls)["temperature"] == "temperature"
    assert cli.main(["train", "--temperature", "0.1"]) == 2


def test_max_new_tokens_is_declared_once():
    """Every command that generates takes the one --max_new_tokens (CompletionOptions: its help and TRL's spelling
    max_completion_length); MeZO's tasks keep MeZO's 50 as their default."""
    declared = next(f for f in dataclasses.fields(CompletionOptions) if f.name == "max_new_tokens")
    takers = {cls.__name__: f for cls in COMMAND_CLASSES for f in dataclasses.fields(cls) if f.name == "max_new_tokens"}
    assert set(takers) == {"Config", "EvalConfig", "CompareConfig", "ChatConfig", "GenerateConfig", "RFTConfig",
                           "GRPOConfig", "DPOConfig"}
    assert all(f.metadata == declared.metadata for f in takers.values())
    assert {name: f.default for name, f in takers.items() if f.default != declared.default} == {
        "Config": 50, "EvalConfig": 50, "CompareConfig": 50}


def test_grpos_loss_is_policy_loss_and_takes_trls_loss_type_spelling(tmp_path):
    """dpo's --loss_type lists preference losses; grpo's loss is --policy_loss, which TRL's loss_type (flag or YAML
    key) still sets."""
    assert "loss_type" not in {f.name for f in dataclasses.fields(GRPOConfig)}
    assert {f.name: f.type for f in dataclasses.fields(DPOConfig)}["loss_type"] == "list[str]"
    args = cli.build_parser().parse_args(["grpo", "--train_file", "q.jsonl", "--loss_type", "dr_grpo"])
    assert parsing.from_namespace(GRPOConfig, args).policy_loss == "dr_grpo"
    (tmp_path / "grpo.yaml").write_text("loss_type: bnpo\n")
    assert parsing.read_yaml(GRPOConfig, str(tmp_path / "grpo.yaml")) == {"policy_loss": "bnpo"}


def test_public_class_names_are_unique_across_the_package():
    where = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path.relative_to(SRC)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}
