"""The calculator tool and the reward functions of `benchmarks/grpo_tools_smollm2.py` (importable: `--tools
calculator_tools:add --reward_funcs calculator_tools:correct calculator_tools:tool_call_shaping`, run from this
folder or with it on the import path).

- `add(a, b)`: the tool, exact integer addition (type hints and a docstring with an Args: section, so transformers
  can describe it to the model).
- `correct`: the correctness reward, 1.0 when the last number of the final assistant turn equals the sum (the row's
  `reference`), else 0.0. A rollout that ends on a tool call (its budget spent) has no final answer: 0.0.
- `tool_call_shaping`: a shaping reward, 1.0 when an assistant turn holds a well-formed call of `add` (the template's
  call parsed, named add, integer arguments a and b), else 0.0; 0.0 on held-out rows (`split` "heldout"), so that
  the held-out mean reward is the accuracy alone.

Held-out rows may carry `stats`, a file path: each time `correct` scores them (the greedy evaluations before and
after training) it appends one JSON line there, {"n", "accuracy", "call_frequency", "well_formed", "example"} (tool
calls per rollout, the share of rollouts with a well-formed call, the first row's completion), since grpo's
metrics.jsonl counts tool calls of the training rollouts only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*")


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def final_answer(completion: Any) -> str:
    """The text of the final assistant turn (a completion as TRL hands it over: a string, or a list of messages)."""
    if isinstance(completion, str):
        return completion
    turns = [m for m in completion if m.get("role") == "assistant"]
    return str(turns[-1].get("content") or "") if turns else ""


def last_number(text: str) -> int | None:
    found = NUMBER.findall(text)
    digits = found[-1].replace(",", "") if found else ""
    return int(digits) if digits.lstrip("-").isdigit() else None


def calls(completion: Any) -> list[dict[str, Any]]:
    """The tool calls of a completion's assistant turns, as the response template parsed them (name, arguments)."""
    if isinstance(completion, str):
        return []
    found = []
    for message in completion:
        if message.get("role") == "assistant":
            found += [call.get("function", call) for call in message.get("tool_calls") or ()]
    return found


def well_formed(call: dict[str, Any]) -> bool:
    arguments = call.get("arguments")
    return call.get("name") == "add" and isinstance(arguments, dict) and set(arguments) == {"a", "b"} and all(
        isinstance(v, int) and not isinstance(v, bool) for v in arguments.values())


def correct(completions: Sequence[Any], reference: Sequence[str], stats: Sequence[str | None] | None = None,
            **_: Any) -> list[float]:
    """1.0 where the final assistant turn's last number is the sum (see the module docstring)."""
    scores = [float(last_number(final_answer(c)) == int(r)) for c, r in zip(completions, reference, strict=True)]
    paths = {p for p in stats or () if p}
    for path in paths:  # held-out rows: one line per evaluation
        chosen = [i for i, p in enumerate(stats) if p == path]
        made = [calls(completions[i]) for i in chosen]
        record = {"n": len(chosen), "accuracy": sum(scores[i] for i in chosen) / len(chosen),
                  "call_frequency": sum(len(m) for m in made) / len(chosen),
                  "well_formed": sum(any(well_formed(c) for c in m) for m in made) / len(chosen),
                  "example": completions[chosen[0]]}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return scores


def tool_call_shaping(completions: Sequence[Any], split: Sequence[str | None] | None = None,
                      **_: Any) -> list[float]:
    """1.0 where an assistant turn calls add well-formed, on training rows (see the module docstring)."""
    splits = split or [None] * len(completions)
    return [0.0 if s == "heldout" else float(any(well_formed(c) for c in calls(completion)))
            for completion, s in zip(completions, splits, strict=True)]
