"""What a run leaves behind: results.json, MeZO's copy of it under its result-file name, and final/; each written
whole (a temporary name, then a rename), so that one that exists is complete."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from xgblora import atomic
from xgblora.adapters.peft import to_peft
from xgblora.config import Config
from xgblora.embeddings.st_format import embedding_export, write_cross_encoder
from xgblora.models.pretrained import RANDOM_MODELS
from xgblora.train.setup import Method

log = logging.getLogger("xgblora")


def result_file_tag(cfg: Config) -> str:
    """MeZO's result file stem: {TASK}-{MODEL}[-sfc][-icl_sfc][-sampleevalN][-ntrainN][-ndevN][-tag]."""
    tag = f"{cfg.task_name}-{cfg.model_name.rstrip('/').split('/')[-1]}"
    tag += "-sfc" if cfg.sfc else ""
    tag += "-icl_sfc" if cfg.icl_sfc else ""
    tag += f"-sampleeval{cfg.num_eval}" if cfg.num_eval is not None else ""
    tag += f"-ntrain{cfg.num_train}" if cfg.num_train else ""
    tag += f"-ndev{cfg.num_dev}" if cfg.num_dev is not None else ""
    tag += f"-{cfg.tag}" if cfg.tag else ""
    return tag


def write_results(cfg: Config, results: dict[str, Any]) -> Path | None:
    """Write results.json into the output folder, and MeZO's copy where --result_file asks for one; returns the copy.

    The copy never replaces a file: two runs with the same MeZO tag (a re-run, another seed of a sweep that
    leaves the tag alone) get `-2`, `-3`, ... before `.json`, and the log names the file written.
    """
    text = json.dumps(results, indent=2, sort_keys=True) + "\n"
    copy = _write_copy(cfg, text) if cfg.result_file else None
    atomic.write_text(Path(cfg.output_dir) / "results.json", text)  # last: its presence means "finished"
    return copy


def _write_copy(cfg: Config, text: str) -> Path:
    """MeZO's copy under --result_file ('auto': MeZO's name in result/), beside any file already there."""
    wanted = Path(cfg.result_file)
    if cfg.result_file == "auto":
        wanted = Path("result") / f"{result_file_tag(cfg)}-trainset{cfg.train_set_seed}.json"
    copy, n = wanted, 1
    while not atomic.create_text(copy, text):
        n += 1
        copy = wanted.with_name(f"{wanted.stem}-{n}{wanted.suffix}")
    if n > 1:
        log.warning("%s exists (another run's result); wrote this run's to %s", wanted, copy)
    return copy


def write_predictions(cfg: Config, records: list[dict[str, Any]]) -> None:
    """predictions.jsonl: one generation of the evaluation split per line (nothing when there are none)."""
    if records:
        atomic.write_jsonl(Path(cfg.output_dir) / "predictions.jsonl", records)


def adapter_task_type(cfg: Config, model: torch.nn.Module) -> str | None:
    """PEFT's task_type of the run's adapter: FEATURE_EXTRACTION for an embedding body (no LM head), else PEFT's
    default for the model."""
    return "FEATURE_EXTRACTION" if cfg.embeds and not hasattr(model, "lm_head") else None


def write_adapter(cfg: Config, method: Method, folder: Path, task_type: str | None = None) -> None:
    """The adapted model as a PEFT LoRA adapter in folder: boosters (merged and current) concatenated, the head as
    modules_to_save; for final/ and for every checkpoint."""
    history = method.boosting.history if method.boosting is not None else []
    to_peft(method.modules, history, folder, cfg.model_name, head=dict(method.head), task_type=task_type)


def save_final(cfg: Config, model: torch.nn.Module, tokenizer: Any, method: Method,
               state: dict[str, torch.Tensor] | None = None) -> None:
    """final/: a PEFT adapter (boosters concatenated) for lora/xgblora, the whole model for full fine-tuning (an
    embedding model's as a sentence-transformers model, a reranker's as a CrossEncoder)."""
    embedding = cfg.embeds
    with atomic.replaced_folder(Path(cfg.output_dir) / "final") as final:
        if method.modules:
            write_adapter(cfg, method, final, adapter_task_type(cfg, model))
        else:
            model.save_pretrained(final, state_dict=state)
            if embedding:  # the whole model: a sentence-transformers model as it stands
                embedding_export(final, dataclasses.asdict(cfg), model.config.hidden_size)
        side = tokenizer.padding_side
        tokenizer.padding_side = "right" if embedding else side  # embeddings read right-padded inputs
        tokenizer.save_pretrained(final)
        tokenizer.padding_side = side  # with an adapter too: the tokenizer and its chat template travel with it
        if cfg.objective == "rerank" and not method.modules:
            write_cross_encoder(final, cfg.max_length)


def _auto_class(final: Path, adapter: bool) -> str:
    """The Auto class that loads final/: PEFT's for an adapter (by its task type), transformers' for a model."""
    if adapter:
        task = json.loads((final / "adapter_config.json").read_text(encoding="utf-8")).get("task_type")
        return {"SEQ_CLS": "AutoPeftModelForSequenceClassification",
                "FEATURE_EXTRACTION": "AutoPeftModelForFeatureExtraction"}.get(task, "AutoPeftModelForCausalLM")
    architectures = json.loads((final / "config.json").read_text(encoding="utf-8")).get("architectures") or [""]
    for suffix in ("ForSequenceClassification", "ForMaskedLM"):
        if architectures[0].endswith(suffix):
            return f"AutoModel{suffix}"
    return "AutoModel" if architectures[0].endswith("Model") else "AutoModelForCausalLM"  # an encoder's body


def write_model_card(cfg: Config, results: dict[str, Any], data: str, tags: Sequence[str] = (),
                     notes: str = "") -> None:
    """final/README.md: what was trained from what, on which data (`data`: a task or a file), with which results,
    and how to load it; `tags` join the card's, `notes` end it."""
    final = Path(cfg.output_dir) / "final"
    if not final.is_dir():
        return
    adapter = (final / "adapter_config.json").exists()
    metrics = {k: v for k, v in results.items() if isinstance(v, float) and k not in ("train_runtime_s",)}
    rows = "".join(f"| {k} | {v:.4g} |\n" for k, v in sorted(metrics.items()))
    auto = _auto_class(final, adapter)
    load = f"from {'peft' if adapter else 'transformers'} import {auto}\nmodel = {auto}.from_pretrained(\"{final}\")"
    if adapter and (cfg.model_name in RANDOM_MODELS or cfg.model_name.startswith("pkg:")):
        # PEFT reads the base from the hub or a folder: a built-in or packaged base loads through xgblora
        load = (f"from xgblora.adapters.trained import load_for_inference\n"
                f"model, tokenizer = load_for_inference(\"{final}\")  # the base {cfg.model_name} with this adapter")
    card = f"""---
base_model: {cfg.model_name}
library_name: {"peft" if adapter else "transformers"}
tags: [{", ".join(["xgblora", cfg.method, "mezo" if cfg.trainer == "zo" else "adamw", *tags])}]
---

# {Path(cfg.output_dir).name}

{"A LoRA adapter" if adapter else "A model"} fine-tuned from `{cfg.model_name}` with xgblora: method `{cfg.method}`
{f"(rank {cfg.rank}, alpha {cfg.alpha:g})" if adapter else "(every weight)"}, trainer `{cfg.trainer}` ({"MeZO" if cfg.trainer == "zo" else "AdamW"}),
{results.get("steps")} steps at learning rate {cfg.learning_rate:g}, on {results.get("num_train")} examples of `{data}`.
The resolved options are in `../config.yaml`.

## Results

| metric | value |
|---|---|
{rows}
## Use

```python
from transformers import AutoTokenizer
{load}
tokenizer = AutoTokenizer.from_pretrained("{final}")
```
"""
    atomic.write_text(final / "README.md", card + (f"\n{notes}" if notes else ""))
