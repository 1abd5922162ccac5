"""A calculator tool and a correctness reward for `xgblora grpo --tools` (docs/grpo.md, "Tools and environments").

Copy this file into the folder you run xgblora from (tools and rewards are imported as module:function from there).
"""

import re


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def correct(completions, answer, **kwargs):
    """1.0 where the last number of the final assistant turn is the row's `answer`, else 0.0."""
    scores = []
    for turns, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", turns[-1]["content"] if turns[-1]["role"] == "assistant" else "")
        scores.append(float(bool(numbers) and numbers[-1] == str(expected)))
    return scores
