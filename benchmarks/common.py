"""What the benchmark scripts share: a run's name as a file name, a table's mean ± std cell, and the rule that
chooses a learning rate from a grid's dev scores, at one seed."""

from __future__ import annotations

import statistics

DEV_SEED = 0  # the seed whose dev scores choose each rate, whichever --seeds a process runs (so seeds can be split)


def slug(name: str) -> str:
    """A run's name as part of a file name: lower case, every character but letters and digits a dash."""
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """'mean ± std' over seeds of values times scale; the mean alone for a single value."""
    mean = f"{statistics.fmean(values) * scale:.{digits}f}"
    return f"{mean} ± {statistics.stdev(values) * scale:.{digits}f}" if len(values) > 1 else mean


def best_rate(dev_scores: dict[float, float], lower_is_better: bool = False) -> float:
    """The rate with the best dev score; a tie goes to the rate listed first (each script lists its grid from the
    smallest rate up, or from its a-priori choice)."""
    sign = -1.0 if lower_is_better else 1.0
    return max(dev_scores, key=lambda lr: sign * dev_scores[lr])  # max keeps the first of equal keys
