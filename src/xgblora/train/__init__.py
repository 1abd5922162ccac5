"""Training runs: `setup` (task, model, what trains), `loop` (the Trainer and its state), `checkpoint` (the
layout, atomic saves), `results` (results.json, final/), and `run`, which ties them together."""

from xgblora.train.loop import Hooks, LoopState, Trainer
from xgblora.train.run import run

__all__ = ["Hooks", "LoopState", "Trainer", "run"]
