"""What a run leaves behind: results.json, MeZO's copy of it under its result-file name, and final/; each written
whole (a temporary name, then a rename), so that one that exists is complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from xgblora import atomic
from xgblora.adapters import export
from xgblora.config import Config
from xgblora.train.setup import Method


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


def write_results(cfg: Config, results: dict[str, Any]) -> None:
    """Write results.json into the output folder and MeZO's copy (--result_file, or result/<tag>-trainset<i>.json)."""
    text = json.dumps(results, indent=2, sort_keys=True) + "\n"
    name = f"{result_file_tag(cfg)}-trainset{cfg.train_set_seed}.json"
    atomic.write_text(Path(cfg.result_file) if cfg.result_file else Path("result") / name, text)
    atomic.write_text(Path(cfg.output_dir) / "results.json", text)  # last: its presence means "finished"


def save_final(cfg: Config, model: torch.nn.Module, tokenizer: Any, method: Method,
               state: dict[str, torch.Tensor] | None = None) -> None:
    """final/: a PEFT adapter (boosters concatenated) for lora/xgblora, the whole model for full fine-tuning."""
    with atomic.replaced_folder(Path(cfg.output_dir) / "final") as final:
        if method.modules:
            history = method.boosting.history if method.boosting is not None else []
            export.to_peft(method.modules, history, final, cfg.model_name, head=dict(method.head))
        else:
            model.save_pretrained(final, state_dict=state)
            tokenizer.save_pretrained(final)
