"""A model folder (config.json, safetensors, tokenizer) written as one GGUF file for llama.cpp, Ollama and LM Studio.

This follows llama.cpp's converter (convert_hf_to_gguf.py: TextModel, LlamaModel, Qwen2Model, get_vocab_base) through
the `gguf` library it ships: the writer, the tensor-name map, SpecialVocab (merges, special token ids, add-BOS/EOS,
the chat template) and the quantisers of gguf.quants. As there, 1-D tensors and norms stay F32, a weight whose rows
do not split into the type's blocks falls back to F16, and Llama's (and Mistral's) Q and K rows are permuted into
llama.cpp's rotary layout (Qwen2 keeps NeoX order). The 4- and 5-bit types keep the token embedding and the output
head at Q8_0, as llama.cpp's own Q4_1 SmolLM2 file does. A model that came from a GGUF file keeps each tensor's type
and the tokenizer's pre-tokenizer name from that file (`Origin`); a 4/5-bit tensor that training changed is written
at Q8_0 (see _origin_type), the ones it did not come out block for block as the file had them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xgblora.errors import UserError

# transformers' model type -> llama.cpp's architecture (Mistral is Llama to llama.cpp, as in its converter)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
# --quantization -> (every 2-D weight's type, the token embedding's and output head's type, general.file_type)
TYPES = {"f32": ("F32", "F32", "ALL_F32"), "f16": ("F16", "F16", "MOSTLY_F16"),
         "bf16": ("BF16", "BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "Q8_0", "MOSTLY_Q8_0"),
         "q5_1": ("Q5_1", "Q8_0", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "Q8_0", "MOSTLY_Q5_0"),
         "q4_1": ("Q4_1", "Q8_0", "MOSTLY_Q4_1"), "q4_0": ("Q4_0", "Q8_0", "MOSTLY_Q4_0")}
WRITTEN = {t for weight, edge, _ in TYPES.values() for t in (weight, edge)}
# llama.cpp's pre-tokenizer names of the split regexes transformers' GGUF loader knows (first name wins)
PRE_TOKENIZERS = ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35")


@dataclass(frozen=True)
class Origin:
    """What a model that came from a GGUF file keeps from it: its quantisation, its tensors (memory-mapped: each
    one's type and blocks), the pre-tokenizer name."""

    quantization: str | None
    tensors: dict[str, Any]
    pre: str | None


def read_origin(path: Path) -> Origin:
    """The Origin of a GGUF file (its metadata and tensor table; the weights stay on disk until compared)."""
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(path)
    file_type = _field(reader, "general.file_type")
    name = LlamaFileType(file_type).name if file_type is not None else None
    quantization = next((q for q, (_, _, ft) in TYPES.items() if ft == name), None)
    return Origin(quantization, {t.name: t for t in reader.tensors}, _field(reader, "tokenizer.ggml.pre"))


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def check_architecture(config: dict[str, Any], where: str) -> str:
    """llama.cpp's architecture name of a model config; one line naming it for an architecture not written."""
    if config.get("model_type") not in ARCHITECTURES:
        found = (config.get("architectures") or [config.get("model_type")])[0]
        raise UserError(f"{where}: GGUF export writes Llama, Mistral and Qwen2 models; this model is {found}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "linear"):
        raise UserError(f"{where}: GGUF export writes default or linear RoPE; this model's is {rope.get('rope_type')}")
    heads, head_dim = config.get("num_attention_heads"), config.get("head_dim")
    if config["model_type"] == "qwen2" and head_dim is not None and head_dim * heads != config["hidden_size"]:
        # llama.cpp's Qwen2 sizes Q and the attention output as hidden_size: such a file would not load
        raise UserError(f"{where}: llama.cpp's Qwen2 needs head_dim x heads = hidden_size; this model has "
                        f"{head_dim} x {heads} and {config['hidden_size']}")
    return ARCHITECTURES[config["model_type"]]


def write(folder: Path, out: Path, quantization: str, origin: Origin | None = None) -> dict[str, Any]:
    """Write the model folder as the GGUF file `out` at `quantization` (see TYPES), named (general.name) after the
    file; return what was written (tensor name -> (shape, type)) and the metadata a reader checks."""
    import gguf

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch = check_architecture(config, str(folder))
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(out.stem)
    writer.add_file_type(gguf.LlamaFileType[TYPES[quantization][2]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(writer, config, arch)
    n_tokens = _add_vocab(writer, folder, config, origin)
    tensors = {}
    for name, tensor in _tensors(folder, config, arch):
        qtype, data = _quantised(name, tensor, quantization, origin)
        writer.add_tensor(name, data, raw_dtype=qtype)
        tensors[name] = (tuple(tensor.shape[::-1]), qtype.name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": arch, "tensors": tensors, "n_tokens": n_tokens}


def _add_hparams(writer: Any, config: dict[str, Any], arch: str) -> None:
    """TextModel.set_gguf_parameters, with LlamaModel's vocabulary size and rotary dimension."""
    import gguf

    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    scaling = config.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    # As the converter, whenever the config names head_dim: without them llama.cpp takes hidden_size / heads as
    # the head size, and refuses a Llama whose head_dim differs (Mistral-Nemo: 5120 / 32 = 160, head_dim 128) as
    # "invalid n_rot"
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim")
                                        or config["hidden_size"] // config["num_attention_heads"])


def _add_vocab(writer: Any, folder: Path, config: dict[str, Any], origin: Origin | None) -> int:
    """llama.cpp's _set_vocab_gpt2: every id up to the model's vocabulary size (holes as [PADn], UNUSED), added
    tokens CONTROL or USER_DEFINED, the merges, special ids and chat template through SpecialVocab, and whether
    the tokenizer adds BOS/EOS and a prefix space as it really does."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    if tokenizer_json["model"]["type"] != "BPE" or tokenizer_json["model"].get("byte_fallback"):
        raise UserError(f"{folder}: GGUF export writes byte-level BPE tokenizers (Llama 3, Qwen2, SmolLM); this "
                        f"one is {tokenizer_json['model']['type']}"
                        f"{' with byte fallback (sentencepiece-style)' if tokenizer_json['model'].get('byte_fallback') else ''}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens, types = _tokens(tokenizer, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(origin.pre if origin and origin.pre else _pre_tokenizer(tokenizer_json, folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    pre = tokenizer_json.get("pre_tokenizer") or {}
    writer.add_add_space_prefix(any(step.get("add_prefix_space") for step in pre.get("pretokenizers", [pre])))
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    probe = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and probe[-1] == tokenizer.eos_token_id
    special.add_to_gguf(writer, quiet=True)
    return len(tokens)


def _tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """get_vocab_base: the token of each id and its type (NORMAL, CONTROL, USER_DEFINED, UNUSED)."""
    from gguf import TokenType

    reverse = {i: token for token, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        if token not in added:
            types.append(TokenType.NORMAL)
        elif decoder[i].special or (token.startswith("<|") and token.endswith("|>")):
            types.append(TokenType.CONTROL)
        else:
            types.append(TokenType.USER_DEFINED)
        tokens.append(token)
    return tokens, types


def _pre_tokenizer(tokenizer_json: dict[str, Any], folder: Path) -> str:
    """llama.cpp's name for the way the tokenizer splits text before BPE: GPT-2's own regex, SmolLM's (single
    digits, then GPT-2's), or a Split regex transformers' GGUF loader knows by name."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    kinds = [(s.get("type"), s.get("use_regex"), s.get("individual_digits")) for s in steps]
    if kinds == [("ByteLevel", True, None)]:
        return "gpt-2"
    if kinds == [("Digits", None, True), ("ByteLevel", True, None)]:
        return "smollm"
    split = next((s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"), None)
    name = next((n for n in PRE_TOKENIZERS if split is not None and GGUF_PRE_TOKENIZER_SPLITS.get(n) == split), None)
    if name is None:
        raise UserError(f"{folder / 'tokenizer.json'}: GGUF export does not know this pre-tokenizer "
                        f"({', '.join(str(k[0]) for k in kinds)}), so llama.cpp would split text differently")
    return name


def estimated_bytes(folder: Path, quantization: str) -> int:
    """About the size of the GGUF file of a model folder: its weights at the bytes per weight of `quantization`'s
    type (the F32 norms and the Q8_0 edges of the 4/5-bit types are a small part)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q
    from safetensors import safe_open

    block, size = GGML_QUANT_SIZES[Q[TYPES[quantization][0]]]
    weights = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            shapes = [handle.get_slice(name).get_shape() for name in handle.keys()]  # noqa: SIM118 -- not a dict
            weights += sum(math.prod(shape) for shape in shapes)
    return weights * size // block


def permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """LlamaModel.permute: Q/K rows from HF's rotate-half layout into llama.cpp's interleaved rotary pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tensors(folder: Path, config: dict[str, Any], arch: str):
    """(GGUF name, fp32 tensor) of every weight, in the safetensors files' order; Q/K permuted for llama. A tied head
    is the token embedding, whichever of the two names the folder stored it under."""
    import gguf
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads")
    files = sorted(folder.glob("*.safetensors"))
    stored = {name for file in files for name in _keys(file)}
    tied = config.get("tie_word_embeddings") and "model.embed_tokens.weight" in stored
    for file in files:
        with safe_open(file, "pt") as handle:
            for name in _keys(file):
                if name == "lm_head.weight" and tied:
                    continue
                new = "token_embd.weight" if name == "lm_head.weight" and config.get("tie_word_embeddings") \
                    else names.get_name(name, try_suffixes=(".weight", ".bias"))
                if new is None:
                    raise UserError(f"{file}: no GGUF name for tensor {name} ({arch})")
                tensor = handle.get_tensor(name).float()
                if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                    tensor = permute(tensor, n_head, n_head)
                if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                    tensor = permute(tensor, n_head, n_kv)
                yield new, tensor


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, "pt") as handle:
        return list(handle.keys())


def _quantised(name: str, tensor: torch.Tensor, quantization: str, origin: Origin | None) -> tuple[Any, np.ndarray]:
    """The tensor's type and its data in it (see the module docstring for which type each tensor gets)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    data = tensor.numpy()
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        return Q.F32, data.astype(np.float32)
    weight, edge, _ = TYPES[quantization]
    qtype = Q[edge if name in ("token_embd.weight", "output.weight") else weight]
    if origin is not None and origin.quantization == quantization and name in origin.tensors:
        qtype = _origin_type(origin.tensors[name], data, qtype)
    try:
        return qtype, quants.quantize(data, qtype)
    except quants.QuantError:  # rows not a whole number of blocks: F16, as llama.cpp's converter falls back
        return Q.F16, quants.quantize(data, Q.F16)


def _origin_type(original: Any, data: np.ndarray, default: Any) -> Any:
    """The type a tensor had in the GGUF file the model came from, except that a tensor training changed goes from
    a 4/5-bit type to Q8_0: its weights sit on the file's 4-bit grid, and re-quantising them to that grid rounds a
    small update back to the original values (measured: LoRA's update on SmolLM2 keeps 6-8% of itself at Q4_1,
    all of it at Q8_0). A type gguf.quants cannot write (K-quants) gives way to the default."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    kept = original.tensor_type
    if kept.name not in WRITTEN:
        return default
    if kept.name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        before = quants.dequantize(original.data, kept).reshape(data.shape)
        return kept if np.array_equal(before, data) else Q.Q8_0
    return kept


def check(path: Path, written: dict[str, Any], chat_template: str | None) -> None:
    """Re-read the file with gguf's reader: the tensors (names, shapes, types), the architecture, the vocabulary
    size and the chat template must be what was written; else nothing is published."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    found = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name) for t in reader.tensors}
    problems = [f"{len(found)} tensors, not {len(written['tensors'])}"] if len(found) != len(written["tensors"]) else []
    problems += [f"{name}: {found.get(name)} read, {shape_type} written"
                 for name, shape_type in written["tensors"].items() if found.get(name) != shape_type]
    expected = {"general.architecture": written["architecture"], "tokenizer.chat_template": chat_template}
    problems += [f"{key}: {_field(reader, key)!r:.60} read, {value!r:.60} written" for key, value in expected.items()
                 if _field(reader, key) != value]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != written["n_tokens"]:
        problems.append(f"the vocabulary does not hold {written['n_tokens']} tokens")
    if problems:
        raise RuntimeError(f"{path}: the GGUF file read back differs from what was written: {'; '.join(problems[:3])}")
