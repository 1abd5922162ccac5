"""The learning rate as a pure function of the step: linear warm-up, then constant, linear to 0, or cosine to 0.

The factors are transformers' `get_scheduler` formulas (constant_with_warmup, linear, cosine with half a cycle),
written as one function of the number of completed steps, so both trainers read the same schedule and a resumed
run needs nothing but the step count. tests/test_fo.py holds it equal to `get_scheduler`'s values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    """peak * factor(step) for step = optimizer steps completed so far (0 for the first update)."""

    kind: str
    peak: float
    max_steps: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown learning-rate schedule {self.kind!r}: choose one of {', '.join(KINDS)}")

    def __call__(self, step: int) -> float:
        """The learning rate of the update that follows `step` completed steps."""
        return self.peak * self.factor(step)

    def factor(self, step: int) -> float:
        """The multiplier of the peak learning rate at `step`."""
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        if self.kind == "constant":
            return 1.0
        decay_steps = float(max(1, self.max_steps - self.warmup_steps))
        if self.kind == "linear":
            return max(0.0, float(self.max_steps - step) / decay_steps)
        progress = float(step - self.warmup_steps) / decay_steps
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
