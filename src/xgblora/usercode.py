"""The user's own code, named as module:function (reward functions, verifiers): imported from the current folder or
the installed packages, and called through one guard, so that what goes wrong in it (an exception, a value of the
wrong type, length or a NaN) is one line naming the function, the row and what was wrong (exit 2), not a
traceback."""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from xgblora.errors import UserError

SPEC = re.compile(r"[\w.]+:\w+")


class UserCodeError(UserError):
    """A user's function failed or returned what it must not; `at` names the row where a caller knows it."""

    def at(self, where: str) -> UserCodeError:
        """The same error with the row in front ('data.jsonl:3: ...')."""
        return UserCodeError(f"{where}: {self}")


def import_function(option: str, spec: str) -> Callable[..., Any]:
    """The function `spec` (module:function) names, imported with the current folder importable (the console
    script's sys.path[0] is its own folder, not the user's); a one-line UserError naming `option` otherwise."""
    module_name, _, function_name = spec.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{option} {spec}: cannot import it from {cwd} or the installed packages "
                        f"({type(exc).__name__}: {exc})") from None
    except SystemExit as exc:  # a script's sys.exit() at module level: no message of its own, and exit would pass
        raise UserError(f"{option} {spec}: importing {module_name} called sys.exit({exc.code!r}); a module of "
                        f"functions must not exit while it is imported (put a script's code under "
                        f"if __name__ == '__main__':)") from None
    except Exception as exc:  # noqa: BLE001 -- the user's module failed while importing: name it, one line
        raise UserError(f"{option} {spec}: importing {module_name} failed ({type(exc).__name__}: {exc})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    if not callable(function):
        raise UserError(f"{option} {spec}: {function_name} is not a function")
    return function


def call(name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """function(*args, **kwargs); an exception it raises becomes one line naming it (`name`, e.g. 'reward
    function my:f') and the exception's type and message."""
    try:
        return function(*args, **kwargs)
    except UserError:
        raise
    except SystemExit as exc:  # it would end the run with the function's exit code and no word of why
        raise UserCodeError(f"{name} called sys.exit({exc.code!r})") from None
    except Exception as exc:  # noqa: BLE001 -- the user's code: any failure is reported, one line
        message = " ".join(str(exc).split()) or "(no message)"
        raise UserCodeError(f"{name} raised {type(exc).__name__}: {message}") from None


@contextlib.contextmanager
def row(where: str) -> Iterator[None]:
    """Name the row (e.g. 'train.jsonl:3') in a UserCodeError raised inside."""
    try:
        yield
    except UserCodeError as exc:
        raise exc.at(where) from None


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}... ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"


def batch(rows: Sequence[str]) -> str:
    """Where a batch of completions came from, for an error about all of them: its first row, and that there are
    others."""
    return rows[0] if len(set(rows)) == 1 else f"{rows[0]} and the other prompts of the batch"


def scores(name: str, values: Any, rows: Sequence[str]) -> list[float]:
    """A reward function's output checked: one real number or None per completion (rows: each completion's
    row), None as NaN (TRL's unscored); a one-line UserCodeError naming the row and the value otherwise."""
    if isinstance(values, (str, bytes, numbers.Number)) or not hasattr(values, "__len__"):
        raise UserCodeError(f"{batch(rows)}: {name} returned {_describe(values)}: a reward function returns a list "
                            f"with one float (or None) per completion")
    values = list(values)
    if len(values) != len(rows):
        raise UserCodeError(f"{batch(rows)}: {name} returned {len(values)} rewards for {len(rows)} completions "
                            f"(one per completion)")
    out = []
    for value, where in zip(values, rows, strict=True):
        if value is not None and not isinstance(value, numbers.Real) and getattr(value, "size", None) in (1, ()):
            value = value.item()  # a one-value tensor or array
        if value is not None and not isinstance(value, numbers.Real):
            raise UserCodeError(f"{where}: {name} returned {_describe(value)}: a reward is a float, or None for "
                                f"a completion it does not score")
        if value is not None and math.isinf(value):
            raise UserCodeError(f"{where}: {name} returned {value}: a reward must be finite (None, or NaN, "
                                f"leaves a completion unscored)")
        out.append(math.nan if value is None else float(value))
    return out


def answer(name: str, value: Any) -> str | None:
    """An answer extractor's output checked: a string or a number (read as its text), or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise UserCodeError(f"{name} returned {_describe(value)}: an answer extractor returns the answer as a string "
                        f"(or a number), or None when there is none")
