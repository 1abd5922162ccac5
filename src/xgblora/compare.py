"""`xgblora compare`: run methods x seeds through the train recipe (`recipes.sft.run`, reusing finished runs), then write the report."""

from __future__ import annotations

import dataclasses
import logging
import traceback
from pathlib import Path
from typing import Any

from xgblora import checkpoint, outputs, report
from xgblora.config import CompareConfig, Config
from xgblora.errors import UserError
from xgblora.logs import setup_console_logging
from xgblora.options import ZO_ESTIMATORS
from xgblora.recipes import sft

log = logging.getLogger("xgblora")


def parse_method(spec: str, default_trainer: str) -> tuple[str, str, str | None]:
    """'xgblora' -> ('xgblora', default_trainer, None); 'lora:regular' -> ('lora', 'regular', None);
    'lora:fzoo' -> ('lora', 'zo', 'fzoo'): a zeroth-order estimator names the trainer zo with that estimator."""
    method, _, trainer = spec.partition(":")
    trainer = trainer or default_trainer
    if method not in ("ft", "lora", "xgblora") or trainer not in ("regular", "zo", *ZO_ESTIMATORS):
        raise UserError(f"--methods: {spec!r} is not METHOD[:TRAINER] with METHOD in ft, lora, xgblora and "
                        f"TRAINER in regular, zo (the run's --zo_estimator), or an estimator: {', '.join(ZO_ESTIMATORS)}")
    if trainer in ZO_ESTIMATORS:
        return method, "zo", trainer
    return method, trainer, None


def run_configs(cfg: CompareConfig) -> list[Config]:
    """One train config per (method, seed), each in its own folder under output_root."""
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)}
    configs = []
    for spec in cfg.methods:
        method, trainer, estimator = parse_method(spec, cfg.trainer)
        for seed in cfg.seeds:
            out = Path(cfg.output_root) / f"{cfg.task_name}-{method}-{estimator or trainer}-seed{seed}"
            values = {**base, "method": method, "trainer": trainer, "seed": seed, "output_dir": str(out),
                      "lora": False, "xgblora": False, "overwrite_output_dir": cfg.overwrite,
                      "result_file": None,  # each run's results.json is in its folder
                      **({"zo_estimator": estimator} if estimator else {})}
            configs.append(Config(**values))
    return configs


def compare(cfg: CompareConfig) -> dict[str, Any]:
    """Run every (method, seed) of cfg not yet finished, keep going past failures, and write the report."""
    setup_console_logging()  # before the first run's "running" line (each run sets it up again, harmlessly)
    outputs.check_folder(Path(cfg.output_root), "--output_root", outputs.holds_runs, "runs of xgblora compare")
    figure = Path(cfg.loss_figure_path) if cfg.loss_figure_path else None
    return run_all(run_configs(cfg), Path(cfg.output_root), figure)


def run_all(configs: list[Config], output_root: Path, loss_figure_path: Path | None = None) -> dict[str, Any]:
    """Run each config whose folder holds no results.json yet (or all, with overwrite_output_dir), then report.

    results.json is written whole, and last, so that a folder holding one is a finished run: a run killed
    part-way (even while writing it) is run again, from its last checkpoint where it saved one.
    """
    finished, failed = [], []
    for run_cfg in configs:
        out = Path(run_cfg.output_dir)
        name = out.name
        if (out / "results.json").exists() and not run_cfg.overwrite_output_dir:
            log.info("%s: finished earlier, reusing it (--overwrite to redo)", name)
            finished.append(out)
            continue
        log.info("%s: running", name)
        if not run_cfg.overwrite_output_dir and checkpoint.step_checkpoints(out / "checkpoints"):
            run_cfg = dataclasses.replace(run_cfg, resume_from_checkpoint="latest")
        try:
            sft.run(run_cfg)
            finished.append(out)
        except UserError as exc:
            failed.append((name, str(exc)))
            log.error("%s failed: %s", name, exc)
        except Exception as exc:  # noqa: BLE001 -- one broken run must not lose the others
            failed.append((name, f"{exc.__class__.__name__}: {exc}"))
            log.error("%s failed:\n%s", name, traceback.format_exc())
    if not finished:
        raise UserError("no run finished: " + "; ".join(f"{n}: {m}" for n, m in failed))
    runs = [report.read_run_summary(out) for out in finished]
    written = report.write_report(runs, output_root, loss_figure_path)
    return {**written, "failed": failed, "summary": report.summary_line(written["rows"])}
