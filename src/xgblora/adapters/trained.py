"""One way in to a trained model, for every command: a base model (hub id, folder, pkg:, built-in), a merged
model folder, a PEFT LoRA adapter folder (its adapter_config.json names the base), or an xgblora run folder
(config.yaml + final/, or the newest intact checkpoint of a run that did not finish), optionally with a PEFT
adapter applied on top (`adapter`).

`resolve` says what a name is (a base, and the adapter folder to apply to it); `load_model` loads the base and
applies the adapter (its classification head too), merged into the weights unless the base is 4-bit;
`load_for_inference` adds the inference settings (KV cache on, eval mode, the run's own tokenizer and chat
template).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from xgblora import checkpoint
from xgblora.adapters.lora import attach_factors, unwrap
from xgblora.adapters.peft import read_adapter
from xgblora.checkpoint import run_config
from xgblora.data import formats
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.options import ModelOptions

_ADAPTER_CONFIG = "adapter_config.json"
# how an embedding run's model embeds: an evaluation of the run folder embeds the same way unless told otherwise
_EMBEDDING_OPTIONS = ("objective", "pooling", "bidirectional", "instruction_format", "query_instruction",
                      "doc_instruction", "include_prompt", "max_length", "matryoshka_dims")
_PAIR_OPTIONS = ("model_name", "eval_file", "columns")
_RERANK_OPTIONS = ("objective", "max_length")
# the base model, task, data, evaluation sample and head a run was trained on: its evaluation takes them unless told
# otherwise
_TASK_OPTIONS = ("model_name", "task_name", "data_dir", "eval_file", "columns", "data_format", "template", "label_words",
                 "label_names", "num_eval", "train_set_seed", "head", "pooling", "max_length")


@dataclass(frozen=True)
class ModelSource:
    """What to load: the base model (a name pretrained.load takes) and the PEFT adapter folder to apply, if any."""

    base: str
    adapter: Path | None = None


def resolve(name_or_path: str, adapter: str | None = None) -> ModelSource:
    """Say what name_or_path (and adapter: a PEFT adapter folder or a run folder) is; see the module docstring."""
    source = _resolve_one(name_or_path)
    if adapter is None:
        return source
    if source.adapter is not None:
        raise UserError(f"--adapter {adapter}: {name_or_path} already carries an adapter ({source.adapter}); give "
                        f"the base model as --model_name")
    folder = Path(adapter)
    if (folder / _ADAPTER_CONFIG).is_file():  # the base given wins over the one the adapter names
        return ModelSource(source.base, folder)
    extra = _run_source(folder) if (folder / "config.yaml").is_file() else ModelSource(adapter)
    if extra.adapter is None and (Path(extra.base) / "config.json").is_file():
        return extra  # full fine-tuning's final/: the trained model is whole and takes the base's place
    if extra.adapter is None:
        raise UserError(f"--adapter {adapter}: not a PEFT adapter folder (no {_ADAPTER_CONFIG}), a full "
                        f"fine-tuning run's model (no config.json) nor an xgblora run folder")
    return ModelSource(source.base, extra.adapter)


def _resolve_one(name_or_path: str) -> ModelSource:
    path = Path(name_or_path)
    if not path.is_dir():
        pretrained.check_name(name_or_path)
        return ModelSource(name_or_path)
    if (path / "config.yaml").is_file():
        return _run_source(path)
    if (path / _ADAPTER_CONFIG).is_file():
        return ModelSource(_adapter_base(path), path)
    return ModelSource(name_or_path)


def _adapter_base(folder: Path) -> str:
    """The base model a PEFT adapter folder names (base_model_name_or_path)."""
    try:
        base = json.loads((folder / _ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder / _ADAPTER_CONFIG}: cannot read ({exc.__class__.__name__})") from None
    if not base:
        raise UserError(f"{folder / _ADAPTER_CONFIG}: names no base_model_name_or_path; give the base model as "
                        f"--model_name and this folder as --adapter")
    return base


def run_folder(path: str | None) -> Path | None:
    """The xgblora run folder that path is, or whose final/ or checkpoint it names; None for anything else."""
    if path is None:
        return None
    given = Path(path).absolute()
    for folder in (given, *given.parents[:3]):
        inside = folder == given or given.is_relative_to(folder / "final") or \
            given.is_relative_to(folder / "checkpoints")
        if inside and (folder / "config.yaml").is_file():
            return folder
    return None


def recorded_base(adapter: str) -> str | None:
    """The base model an adapter was trained on, as it records it: its run's config.yaml (a run folder, its final/
    or a checkpoint of it), else a PEFT folder's adapter_config.json; None for anything else (full fine-tuning's
    final/ is a whole model and needs no base)."""
    run = run_folder(adapter)
    if run is not None:
        return run_config(run)["model_name"]
    folder = Path(adapter)
    return _adapter_base(folder) if (folder / _ADAPTER_CONFIG).is_file() else None


def run_options(model_name: str, adapter: str | None = None) -> dict[str, Any]:
    """What an evaluation of a trained run (--model_name RUN, or --adapter RUN, RUN/final or a checkpoint of it)
    takes from the run unless told otherwise: an embedding run's embedding options and evaluation pairs, a
    reranker's objective, length and evaluation rows, another run's task, data and head; {} when neither names a
    run."""
    folder = next((f for f in (run_folder(adapter), run_folder(model_name)) if f is not None), None)
    if folder is None:
        return {}
    cfg = run_config(folder)
    objective = cfg.get("objective", "lm")
    keys = _TASK_OPTIONS if objective == "lm" else \
        (_RERANK_OPTIONS if objective == "rerank" else _EMBEDDING_OPTIONS) + _PAIR_OPTIONS
    return {key: cfg[key] for key in keys if cfg.get(key) is not None}


def _run_source(run_dir: Path) -> ModelSource:
    """A run folder: final/ (an adapter, or full fine-tuning's whole model), else its newest intact checkpoint."""
    cfg, final = run_config(run_dir), run_dir / "final"
    if (final / _ADAPTER_CONFIG).is_file():
        return ModelSource(cfg["model_name"], final)
    if (final / "config.json").is_file():
        return ModelSource(str(final))
    if not checkpoint.step_checkpoints(run_dir / "checkpoints"):
        raise UserError(f"{run_dir}: the run has neither final/ nor a checkpoint to load")
    path = checkpoint.find(run_dir / "checkpoints", "latest")
    if cfg.get("method") == "ft":
        raise UserError(f"{run_dir}: an unfinished full fine-tuning run; export its checkpoint first: xgblora export "
                        f"{run_dir} --checkpoint {path.name} --format merged --output_dir DIR")
    return ModelSource(cfg["model_name"], checkpoint.adapter_folder(path))


def carries_head(base: str, adapter: str | None) -> bool:
    """Whether the model loads with a trained classification head: the adapter's (PEFT's modules_to_save), or the
    head of a saved sequence-classification model."""
    return head_outputs(ModelSource(base, Path(adapter) if adapter is not None else None)) is not None


def head_outputs(source: ModelSource, trust_remote_code: bool = False) -> int | None:
    """The outputs of the trained sequence-classification head the source loads with: its adapter's head (PEFT's
    modules_to_save), or a saved *ForSequenceClassification model's num_labels; None where there is none."""
    if source.adapter is not None:
        return _labels(read_adapter(source.adapter)[1])
    if source.base in pretrained.RANDOM_MODELS:
        return None
    try:
        config = AutoConfig.from_pretrained(pretrained.resolve_path(source.base), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    return config.num_labels if (config.architectures or [""])[0].endswith("ForSequenceClassification") else None


def _labels(head: dict[str, torch.Tensor]) -> int | None:
    """A classifier head's outputs: its output layer is its narrowest weight (labels < hidden size), [labels,
    hidden]; None for no head."""
    return min((t.shape[0] for t in head.values() if t.dim() == 2), default=None)


def apply_adapter(model: torch.nn.Module, folder: Path, merge: bool) -> None:
    """Put a PEFT LoRA adapter (and its classification head) on the model, merged into the weights when asked."""
    factors, head = read_adapter(folder)
    if head:
        missing = set(head) - dict(model.named_parameters()).keys()
        if missing:
            raise UserError(f"{folder}: the adapter's head tensors {sorted(missing)[:3]} are not parameters of the "
                            f"base model")
        model.load_state_dict(head, strict=False)
    attach_factors(model, factors)
    if merge:
        unwrap(model)


def load_model(source: ModelSource, *, dtype: str = "float32", device: str = "cpu", attn_implementation: str = "auto",
               trust_remote_code: bool = False, load_in_4bit: bool = False, head: str = "auto",
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base model with the source's adapter applied: merged (fp32 sums, cast once) unless the base is 4-bit,
    where the adapter stays attached in fp32. The tokenizer is the adapter folder's when it has one."""
    adapter_head = read_adapter(source.adapter)[1] if source.adapter is not None else {}
    num_labels = _labels(adapter_head)
    # an adapter with a trained classification head loads on a classifier (a reward model's, say)
    kind = "classifier" if head == "auto" and num_labels else pretrained.resolve_head(head, source.base,
                                                                                     trust_remote_code)
    model, tokenizer = pretrained.load(source.base, dtype=dtype, attn_implementation=attn_implementation, device=device,
                                   trust_remote_code=trust_remote_code, head=kind, num_labels=num_labels,
                                   load_in_4bit=load_in_4bit)
    if source.adapter is not None:
        apply_adapter(model, source.adapter, merge=not load_in_4bit)
        if (source.adapter / "tokenizer_config.json").is_file():  # final/ carries the run's tokenizer and template
            tokenizer = _own_tokenizer(source.adapter, tokenizer, trust_remote_code)
    return model, tokenizer


def _own_tokenizer(folder: Path, loaded: PreTrainedTokenizerBase,
                   trust_remote_code: bool) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = loaded.padding_side
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_for_inference(name_or_path: str, adapter: str | None = None, *, dtype: str = "float32", device: str = "cpu",
                       attn_implementation: str = "auto", trust_remote_code: bool = False,
                       load_in_4bit: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A trained model ready to generate: any source `resolve` takes, the adapter merged unless 4-bit, eval mode,
    the KV cache on, padding on the left."""
    model, tokenizer = load_model(resolve(name_or_path, adapter), dtype=dtype, device=device,
                                  attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
                                  load_in_4bit=load_in_4bit)
    model.config.use_cache = True
    model.eval()
    return model, tokenizer


def load_with_options(options: ModelOptions, name_or_path: str, adapter: str | None, chat_template: str | None
                      ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`load_for_inference` with a command's model options (dtype, device, attention, remote code, 4-bit), and its
    --chat_template file, if any, replacing the tokenizer's."""
    template = formats.read_chat_template(chat_template) if chat_template else None
    model, tokenizer = load_for_inference(name_or_path, adapter, dtype=options.dtype_name, device=options.device,
                                          attn_implementation=options.attn_implementation,
                                          trust_remote_code=options.trust_remote_code,
                                          load_in_4bit=options.load_in_4bit)
    if template is not None:
        tokenizer.chat_template = template
    return model, tokenizer


def run_head(cfg: dict[str, Any], model_name: str, trust_remote_code: bool) -> str:
    """The model class a run's model loads as: its embedding class for an embedding objective, a sequence
    classifier for a reranker, else its --head."""
    if cfg.get("objective") == "rerank":
        return "classifier"
    if cfg.get("objective", "lm") != "lm":
        return pretrained.embedding_head(model_name, cfg["objective"], trust_remote_code)
    return cfg.get("head", "auto")


def load_run_model(run_dir: Path, trust_remote_code: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """A finished run's trained model in memory (its adapter merged into the base, or its full final/ model), its
    tokenizer, and its config.yaml as a dict."""
    cfg = run_config(Path(run_dir))
    if cfg.get("trust_remote_code") and not trust_remote_code:
        raise UserError(f"{run_dir} was trained with --trust_remote_code; pass --trust_remote_code to load it")
    source = resolve(str(run_dir))
    model, tokenizer = load_model(source, trust_remote_code=trust_remote_code,
                                          head=run_head(cfg, source.base, trust_remote_code))
    return model, tokenizer, cfg
