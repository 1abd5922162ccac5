"""Training runs: `setup` (task, model, what trains, the evaluator), `objective` (the loss of each batch kind),
`head` (a new classifier head: probe, first-order training beside MeZO), `loop` (the Trainer and its state), `lock`
(one run per output folder), `results` (results.json, final/). The commands that run them are in `recipes/`."""

from xgblora.train.loop import Hooks, LoopState, Trainer

__all__ = ["Hooks", "LoopState", "Trainer"]
