"""Training runs: `setup` (task, model, what trains), `loop` (the Trainer and its state), `checkpoint` (the
layout, atomic and verified saves), `lock` (one run per output folder), `results` (results.json, final/), and
`run`, which ties them together."""

from xgblora.train.loop import Hooks, LoopState, Trainer
from xgblora.train.run import run

__all__ = ["Hooks", "LoopState", "Trainer", "run"]
