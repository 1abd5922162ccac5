"""What the benchmark scripts share: a run's name as a file name, and a table's mean ± std cell."""

from __future__ import annotations

import statistics


def slug(name: str) -> str:
    """A run's name as part of a file name: lower case, every character but letters and digits a dash."""
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """'mean ± std' over seeds of values times scale; the mean alone for a single value."""
    mean = f"{statistics.fmean(values) * scale:.{digits}f}"
    return f"{mean} ± {statistics.stdev(values) * scale:.{digits}f}" if len(values) > 1 else mean
