"""One run lifecycle for every training command: `train`, `dpo` and `grpo` leave the same outputs (config.yaml,
final/ with its model card, results.json with the device and the torch version), and the card's own loading code
loads the trained model, as PEFT loads the adapter."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file

from xgblora import cli
from xgblora.models import pretrained


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lifecycle")
    questions = [{"question": f"Which is larger, {a} or {b}?", "answer": f"#### {max(a, b)}"}
                 for a, b in [(1, 2), (5, 3), (4, 9), (8, 6)]]
    (folder / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in questions))
    pairs = [{"prompt": f"{a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a + b + 1}"} for a, b in [(1, 2), (3, 4)]]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    # a random model is never right: a reward it earns half the time (an odd first token) gives advantages
    (folder / "parity_reward.py").write_text(
        "def odd_first(completion_ids, **kwargs):\n    return [float(ids[0] % 2) for ids in completion_ids]\n")
    return folder


COMMON = ["--model_name", "tiny-llama", "--method", "lora", "--learning_rate", "1e-2", "--max_steps", "2",
          "--save_strategy", "no", "--device", "cpu"]
COMMANDS = {
    "train": (["train", "--task_name", "custom", "--train_file", "q.jsonl", "--columns",
               "prompt=question,completion=answer", "--per_device_train_batch_size", "2", "--no_eval"], "q.jsonl"),
    "dpo": (["dpo", "--train_file", "pairs.jsonl", "--per_device_train_batch_size", "2"], "pairs.jsonl"),
    "grpo": (["grpo", "--train_file", "q.jsonl", "--columns", "prompt=question,completion=answer", "--reward_funcs",
              "parity_reward:odd_first", "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_new_tokens", "4",
              "--eval_on_start", "false"], "q.jsonl"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_writes_config_model_card_and_results_alike(command, files, monkeypatch, capsys):
    args, data = COMMANDS[command]
    out = files / command
    monkeypatch.chdir(files)
    monkeypatch.syspath_prepend(str(files))
    assert cli.main([*args, *COMMON, "--output_dir", str(out)]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["device"] == "cpu" and results["torch"] == torch.__version__
    assert {k: results[k] for k in ("model", "method", "trainer", "steps")} == \
        {"model": "tiny-llama", "method": "lora", "trainer": "regular", "steps": 2}
    assert yaml.safe_load((out / "config.yaml").read_text())["model_name"] == "tiny-llama"
    card = (out / "final" / "README.md").read_text()
    assert "base_model: tiny-llama" in card and f"on {results['num_train']} examples of `{data}`" in card
    assert (command in re.search(r"tags: \[(.*)\]", card)[1]) == (command != "train")

    scope: dict = {}
    exec(re.search(r"```python\n(.*?)```", card, re.S)[1], scope)  # the card's own loading code
    base, _ = pretrained.random_model("tiny-llama")
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        theirs = PeftModel.from_pretrained(base, out / "final").eval()(input_ids=ids).logits
        ours = scope["model"].eval()(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ours, plain)  # trained: the adapter is not zero


@pytest.mark.parametrize("flag,refusal", [
    ("--activation_offloading", "--activation_offloading moves saved activations from a CUDA device"),
    ("--use_liger_kernel", "--use_liger_kernel: Liger's kernels are Triton kernels for CUDA devices"),
])
@pytest.mark.parametrize("command", COMMANDS)
def test_cuda_memory_options_reach_every_commands_loop_and_a_cpu_run_refuses_them(command, flag, refusal, files,
                                                                                  monkeypatch, capsys):
    """The parser takes the option and the loop reads it: on the CPU, the one line that refuses it."""
    args, _ = COMMANDS[command]
    monkeypatch.chdir(files)
    monkeypatch.syspath_prepend(str(files))
    code = cli.main([*args, *COMMON, flag, "--output_dir", str(files / f"{flag[2:]}-{command}")])
    err = capsys.readouterr().err
    assert code == 2 and refusal in err, err


def test_rft_rounds_train_with_the_memory_options_of_the_command():
    from xgblora.config import RFTConfig
    from xgblora.recipes.rft import training_config

    cfg = RFTConfig(model_name="tiny-llama", train_file="q.jsonl", eval_file="h.jsonl", output_root="out",
                    method="lora", activation_offloading=True, gradient_checkpointing=True, compile=True,
                    use_liger_kernel=True)
    trained = training_config(cfg, "tiny-llama", None, Path("out/round-1"), 4)
    assert trained.activation_offloading and trained.gradient_checkpointing and trained.compile
    assert trained.use_liger_kernel


@pytest.mark.parametrize("command", COMMANDS)
def test_compile_reaches_every_commands_training_forward(command, files, monkeypatch, capsys):
    """--compile: the training loss runs the compiled model (torch.compile stands in with a recording identity here:
    compiling takes minutes on a CPU), without the fused LM head."""
    from xgblora.train import setup

    compiled = []
    monkeypatch.setattr(setup.torch, "compile", lambda model: compiled.append(model) or model)
    args, _ = COMMANDS[command]
    monkeypatch.chdir(files)
    monkeypatch.syspath_prepend(str(files))
    assert cli.main([*args, *COMMON, "--compile", "--output_dir", str(files / f"compile-{command}")]) == 0, \
        capsys.readouterr().err
    assert len(compiled) == 1


@pytest.mark.parametrize("command", COMMANDS)
def test_gradient_checkpointing_trains_every_command_as_without(command, files, monkeypatch, capsys):
    """--gradient_checkpointing (the cache-keeping replay under dpo's and grpo's shared-prompt forward): the same
    logged losses and the same adapter as the run without it."""
    from xgblora.train import loop

    enabled, enable = [], loop.enable_checkpointing
    monkeypatch.setattr(loop, "enable_checkpointing", lambda model: enabled.append(model) or enable(model))
    args, _ = COMMANDS[command]
    monkeypatch.chdir(files)
    monkeypatch.syspath_prepend(str(files))
    runs = []
    for flag in ([], ["--gradient_checkpointing"]):
        out = files / f"gc-{command}-{len(flag)}"
        assert cli.main([*args, *COMMON, *flag, "--logging_steps", "1", "--output_dir", str(out)]) == 0, \
            capsys.readouterr().err
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs.append(([m["loss"] for m in logged if "loss" in m], load_file(out / "final" / "adapter_model.safetensors")))
    (plain_losses, plain), (losses, checkpointed) = runs
    assert len(enabled) == 1  # the second run checkpointed its model
    assert len(losses) == 2 and losses == pytest.approx(plain_losses, rel=1e-5)
    assert plain.keys() == checkpointed.keys()
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=1e-5, atol=1e-6)
