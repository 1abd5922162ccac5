"""The Countdown reward of "Evolution Strategies at Scale" (Qiu et al., arXiv 2509.24372) as an `xgblora grpo
--reward_funcs countdown_reward:reward` function, for benchmarks/countdown_es.py.

The grader is the reference's own `reward_function` (countdown/countdown_task.py of
github.com/VsonicV/es-fine-tuning-paper), imported at run time from a checkout named by $COUNTDOWN_REF_DIR, not
copied: that code is under its authors' Academic Public License, this project under MIT. This module only applies it
as the reference's `evaluate_model` does:

* the graded text is the whole decoded output, prompt and completion (the reference decodes `generate`'s output
  rows, prompt included, and cuts at "assistant:" only where that appears), so the prompt's own `<think> </think>`
  and `<answer> </answer>` tags count towards the format reward, as there;
* the numbers are read from the prompt's "[a b c]" and the target from the row's `target` string, as there.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

REF_ENV = "COUNTDOWN_REF_DIR"


@functools.cache
def reference_grader() -> Callable[..., dict[str, Any]]:
    """countdown_task.reward_function from the reference checkout in $COUNTDOWN_REF_DIR."""
    folder = os.environ.get(REF_ENV)
    if not folder:
        raise RuntimeError(f"set {REF_ENV} to a checkout of github.com/VsonicV/es-fine-tuning-paper")
    path = Path(folder) / "countdown" / "countdown_task.py"
    spec = importlib.util.spec_from_file_location("countdown_task", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_function


def numbers_of(prompt: str) -> list[int] | None:
    """The numbers between the prompt's first '[' and first ']', as the reference's evaluate_model reads them."""
    start, end = prompt.find("["), prompt.find("]")
    if start == -1 or end == -1:
        return None
    return [int(n) for n in prompt[start + 1:end].split() if n.isdigit()]


def grade(prompt: str, output: str, target: str) -> float:
    """The reference's reward of one decoded output (prompt + completion) for its prompt and target string."""
    response = output.split("assistant:")[-1].strip() if "assistant:" in output else output
    return reference_grader()(response, numbers_of(prompt), int(target) if target.isdigit() else None)["reward"]


def reward(prompts: list[str], completions: list[str], target: list[Any], **_: Any) -> list[float]:
    """TRL's reward signature: each completion graded on its prompt + completion, as the reference grades."""
    return [grade(p, p + c, str(t)) for p, c, t in zip(prompts, completions, target, strict=True)]
