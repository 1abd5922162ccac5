"""Training runs: `setup` (task, model, what trains, the evaluator), `objective` (the loss of each batch kind),
`head` (a new classifier head: probe, first-order training beside MeZO), `loop` (the Trainer and its state), `lock`
(one run per output folder), `results` (results.json, final/), and `run`, which ties them together."""

from xgblora.train.loop import Hooks, LoopState, Trainer
from xgblora.train.run import run

__all__ = ["Hooks", "LoopState", "Trainer", "run"]
