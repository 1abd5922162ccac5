"""Experiment trackers for --report_to, through Accelerate's tracker classes: TensorBoard, Weights & Biases, MLflow,
Trackio, several at once. Each is set up to keep its files in the run's output folder (offline modes work: e.g.
WANDB_MODE=offline, MLflow's file store) unless its own environment variables point elsewhere."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xgblora.errors import UserError

if TYPE_CHECKING:
    from accelerate.tracking import GeneralTracker

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}  # -> package


def parse_report_to(value: str) -> tuple[str, ...]:
    """'tensorboard,mlflow' (or spaces) -> ('tensorboard', 'mlflow'); 'none' -> (); unknown names are refused."""
    names = tuple(dict.fromkeys(n for n in value.replace(",", " ").split() if n != "none"))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise UserError(f"--report_to {value!r}: unknown tracker {unknown[0]!r}; choose from none, "
                        f"{', '.join(TRACKERS)} (several: comma-separated)")
    return names


def open_trackers(names: tuple[str, ...], output_dir: Path, run_name: str, config: dict[str, Any],
                  resume_step: int | None = None) -> list[GeneralTracker]:
    """Started trackers with the run's config stored; resume_step: TensorBoard drops its events after that step."""
    trackers = []
    for name in names:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise UserError(f"--report_to {name} needs the {TRACKERS[name]} package: pip install {TRACKERS[name]}")
        tracker = _tracker(name, output_dir, run_name, resume_step)
        tracker.start()
        tracker.store_init_configuration({k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                          for k, v in config.items()})
        trackers.append(tracker)
    return trackers


def _tracker(name: str, output_dir: Path, run_name: str, resume_step: int | None) -> GeneralTracker:
    from accelerate import tracking

    if name == "tensorboard":
        purge = {"purge_step": resume_step + 1} if resume_step is not None else {}
        return tracking.TensorBoardTracker("tensorboard", output_dir, **purge)  # writes output_dir/tensorboard
    if name == "wandb":
        return tracking.WandBTracker(run_name, dir=str(output_dir))
    if name == "mlflow":  # MLflow's default store is in the working directory: keep it in the run's folder
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:
            mlflow.set_tracking_uri(f"sqlite:///{(output_dir / 'mlflow.db').resolve()}")
        return tracking.MLflowTracker(experiment_name="xgblora", run_name=run_name)
    return tracking.TrackioTracker(run_name)
