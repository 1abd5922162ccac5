"""Answers, for every grader: SQuAD's normalisation and token F1 (MeZO's generation tasks, instruction data), and
the verifiers of rejection sampling, which pull the final answer out of a completion and the reference and compare.

An extractor is picked by name: `gsm8k` (the number after the last `####`; a completion without one has no answer,
so only completions in the format being trained are kept), `answer_tags` (the text of the last
`<answer>...</answer>`), `regex:PATTERN` (the last match; its first group when it has one), or `module:function`
(a function of the text returning the answer or None, imported from the user's module). Two answers agree when
both read as numbers within a relative tolerance, or else as equal normalised strings (SQuAD's normalisation).
"""

from __future__ import annotations

import collections
import importlib
import os
import re
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xgblora.errors import UserError

Extractor = Callable[[str], "str | None"]

_NUMBER = re.compile(r"^[-+]?\$?\d[\d,]*(?:\.\d+)?%?$|^[-+]?\$?\.\d+%?$")
_FIRST_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?")
_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """Token-overlap F1 between a prediction and one reference (SQuAD's definition)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def gsm8k_answer(text: str) -> str | None:
    """The first number after the last '####', or None."""
    if "####" not in text:
        return None
    found = _FIRST_NUMBER.search(text.rsplit("####", 1)[1])
    return found.group(0) if found else None


def tagged_answer(text: str) -> str | None:
    """The text inside the last <answer>...</answer>, or None."""
    found = _TAGS.findall(text)
    return found[-1].strip() if found else None


def regex_extractor(pattern: str) -> Extractor:
    """The last match of a regular expression (its first group, when it has groups)."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise UserError(f"--verifier regex:{pattern}: not a regular expression ({exc})") from None

    def extract(text: str) -> str | None:
        matches = list(compiled.finditer(text))
        if not matches:
            return None
        return matches[-1].group(1 if compiled.groups else 0)

    return extract


def user_extractor(spec: str) -> Extractor:
    """A function given as module:function, imported from the user's code (the current folder is importable)."""
    module_name, _, function_name = spec.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path  # the console script's sys.path[0] is its own folder, not the user's
    if added:
        sys.path.insert(0, cwd)
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"--verifier {spec}: cannot import it from {cwd} or the installed packages "
                        f"({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # noqa: BLE001 -- the user's module failed while importing: name it, one line
        raise UserError(f"--verifier {spec}: importing {module_name} failed ({type(exc).__name__}: {exc})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    if not callable(function):
        raise UserError(f"--verifier {spec}: {function_name} is not a function")
    return function


def make_extractor(spec: str) -> Extractor:
    """The extractor a --verifier value names (see the module docstring)."""
    if spec == "gsm8k":
        return gsm8k_answer
    if spec == "answer_tags":
        return tagged_answer
    if spec.startswith("regex:"):
        return regex_extractor(spec[len("regex:"):])
    if re.fullmatch(r"[\w.]+:\w+", spec):
        return user_extractor(spec)
    raise UserError(f"--verifier {spec!r}: choose gsm8k, answer_tags, regex:PATTERN, or module:function")


def _as_number(text: str) -> float | None:
    text = text.strip()
    if not _NUMBER.match(text):
        return None
    return float(text.replace(",", "").replace("$", "").rstrip("%"))


def same_answer(got: str, want: str, tolerance: float = 1e-6) -> bool:
    """Whether two extracted answers agree: as numbers within a relative tolerance, else as normalised strings."""
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None:
        return abs(a - b) <= tolerance * max(1.0, abs(b))
    return normalize_answer(got) == normalize_answer(want)


@dataclass
class Verifier:
    """Judges completions against a reference with one extractor and one tolerance."""

    extract: Extractor
    tolerance: float = 1e-6

    def reference_answer(self, reference: str) -> str:
        """The reference's answer; a reference the extractor finds nothing in is used whole."""
        found = self.extract(reference)
        return reference.strip() if found is None else str(found)

    def judge(self, completions: Sequence[str], reference: str) -> list[bool]:
        """Whether each completion is correct; each is extracted once, as a user's extractor may be costly."""
        want = self.reference_answer(reference)
        found = [self.extract(text) for text in completions]
        return [got is not None and same_answer(str(got), want, self.tolerance) for got in found]


def keep_correct(completions: Sequence[str], verdicts: Sequence[bool], limit: int) -> list[str]:
    """The correct completions, duplicates (up to surrounding white space) removed, at most `limit`, in order."""
    kept: dict[str, str] = {}
    for text, correct in zip(completions, verdicts, strict=True):
        if correct and len(kept) < limit:
            kept.setdefault(text.strip(), text)
    return list(kept.values())
