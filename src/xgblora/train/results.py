"""What a run leaves behind: results.json, MeZO's copy of it under its result-file name, and final/."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from xgblora.adapters import export
from xgblora.config import Config
from xgblora.train.setup import Method

log = logging.getLogger("xgblora")


def result_file_tag(cfg: Config) -> str:
    """MeZO's result file stem: {TASK}-{MODEL}[-sfc][-icl_sfc][-sampleevalN][-ntrainN][-ndevN][-tag]."""
    tag = f"{cfg.task_name}-{cfg.model_name.rstrip('/').split('/')[-1]}"
    tag += "-sfc" if cfg.sfc else ""
    tag += "-icl_sfc" if cfg.icl_sfc else ""
    tag += f"-sampleeval{cfg.num_eval}" if cfg.num_eval is not None else ""
    tag += f"-ntrain{cfg.num_train}" if cfg.num_train > 0 else ""
    tag += f"-ndev{cfg.num_dev}" if cfg.num_dev is not None else ""
    tag += f"-{cfg.tag}" if cfg.tag else ""
    return tag


def write_results(cfg: Config, results: dict[str, Any]) -> Path | None:
    """Write results.json into the output folder, and MeZO's copy where --result_file asks for one; returns the copy.

    The copy never replaces a file: two runs with the same MeZO tag (a re-run, another seed of a sweep that
    leaves the tag alone) get `-2`, `-3`, ... before `.json`, and the log names the file written.
    """
    text = json.dumps(results, indent=2, sort_keys=True) + "\n"
    (Path(cfg.output_dir) / "results.json").write_text(text, encoding="utf-8")
    if not cfg.result_file:
        return None
    wanted = Path(cfg.result_file)
    if cfg.result_file == "auto":
        wanted = Path("result") / f"{result_file_tag(cfg)}-trainset{cfg.train_set_seed}.json"
    wanted.parent.mkdir(parents=True, exist_ok=True)
    copy, n = wanted, 1
    while True:
        try:
            with open(copy, "x", encoding="utf-8") as f:  # "x" fails if the file exists: no race between runs
                f.write(text)
            break
        except FileExistsError:
            n += 1
            copy = wanted.with_name(f"{wanted.stem}-{n}{wanted.suffix}")
    if n > 1:
        log.warning("%s exists (another run's result); wrote this run's to %s", wanted, copy)
    return copy


def write_predictions(cfg: Config, records: list[dict[str, Any]]) -> None:
    """predictions.jsonl: one generation of the evaluation split per line (nothing when there are none)."""
    if not records:
        return
    path = Path(cfg.output_dir) / "predictions.jsonl"
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    partial.replace(path)


def save_final(cfg: Config, model: torch.nn.Module, tokenizer: Any, method: Method,
               state: dict[str, torch.Tensor] | None = None) -> None:
    """final/: a PEFT adapter (boosters concatenated) for lora/xgblora, the whole model for full fine-tuning."""
    final = Path(cfg.output_dir) / "final"
    if method.modules:
        history = method.boosting.history if method.boosting is not None else []
        export.to_peft(method.modules, history, final, cfg.model_name, head=dict(method.head))
    else:
        model.save_pretrained(final, state_dict=state)
        tokenizer.save_pretrained(final)
