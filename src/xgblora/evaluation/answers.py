"""Answers, for every grader: SQuAD's normalisation and token F1 (MeZO's generation tasks, instruction data), and
the verifiers of rejection sampling, which pull the final answer out of a completion and the reference and compare.

An extractor is picked by name: `gsm8k` (the first number on the line of the first `####`, as GSM8K's own grader and
ScRel's `extract_answer` read it (OFA-Sys/gsm8k-ScRel, collect_rejection_sampling.py: `ANS_RE.search`); a completion
without one has no answer, so only completions in the format being trained are kept; the one GSM8K grader of the
project, also instruction evaluation's), `answer_tags` (the text of the last
`<answer>...</answer>`), `regex:PATTERN` (the last match; its first group when it has one), `math` (the
math-verify package's reading and symbolic comparison, as TRL's accuracy_reward: LaTeX, `\\boxed{}`, fractions,
equivalent forms), or `module:function`
(a function of the text returning the answer or None, imported from the user's module). Two answers agree when
both read as numbers within a relative tolerance, or else as equal normalised strings (SQuAD's normalisation).

The correct completions of a question are then filtered and de-duplicated as RFT's reference does
(OFA-Sys/gsm8k-ScRel, collect_rejection_sampling.py, `collect`): a completion whose calculator annotations
`<<lhs=rhs>>` do not hold (`check_equation`: lhs evaluated, within 1e-3 of rhs) is rejected, and of the completions
with the same list of equations only the one farthest (summed edit distance) from the others kept is kept.
"""

from __future__ import annotations

import ast
import collections
import operator
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xgblora import usercode
from xgblora.errors import UserError

Extractor = Callable[[str], "str | None"]

_NUMBER = re.compile(r"^[-+]?\$?\d[\d,]*(?:\.\d+)?%?$|^[-+]?\$?\.\d+%?$")
_FIRST_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?")
_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EQUATION = re.compile(r"<<([^>]*)>>")  # ScRel's pattern: everything inside << >>


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
    """The first number on the line of the first '####', or None: "#### 72\n\nQuestion: ...\n#### 9" answers 72 (a
    model that goes on to write a new question after its answer has still answered)."""
    if "####" not in text:
        return None
    found = _FIRST_NUMBER.search(text.split("####", 1)[1].split("\n", 1)[0])
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
    """A function given as module:function, imported from the user's code (the current folder is importable) and
    called through the guard: an exception, or a value not a string, a number or None, is one line."""
    function = usercode.import_function("--verifier", spec)
    name = f"--verifier {spec}"

    def extract(text: str) -> str | None:
        return usercode.answer(name, usercode.call(name, function, text))

    return extract


def make_verifier(spec: str, tolerance: float = 1e-6) -> Verifier | MathVerifier:
    """The verifier a --verifier value names: `math` (math-verify's), else an extractor's (see the module
    docstring)."""
    return MathVerifier() if spec == "math" else Verifier(make_extractor(spec), tolerance)


def make_extractor(spec: str) -> Extractor:
    """The extractor a --verifier value names (see the module docstring)."""
    if spec == "gsm8k":
        return gsm8k_answer
    if spec == "math":
        return MathVerifier().extract
    if spec == "answer_tags":
        return tagged_answer
    if spec.startswith("regex:"):
        return regex_extractor(spec[len("regex:"):])
    if re.fullmatch(r"[\w.]+:\w+", spec):
        return user_extractor(spec)
    raise UserError(f"--verifier {spec!r}: choose gsm8k, math, answer_tags, regex:PATTERN, or module:function")


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

    def scores(self, completions: Sequence[str], reference: str) -> list[float | None]:
        """1.0 for each correct completion, else 0.0 (a reward)."""
        return [float(ok) for ok in self.judge(completions, reference)]


class MathVerifier:
    """Mathematical answers judged by the math-verify package as TRL's `accuracy_reward` judges them: the reference
    parsed whole, the completion's first LaTeX answer (\\boxed{} first, units normalised), compared symbolically
    (equivalent forms, fractions, sets, intervals). A reference it cannot parse is no judgement (None)."""

    def __init__(self) -> None:
        try:
            import math_verify
            from latex2sympy2_extended import NormalizationConfig
        except ImportError:
            raise UserError("the math verifier needs the math-verify package: pip install math-verify (or the "
                            "`math` extra)") from None
        self._mv = math_verify
        self._config = [math_verify.LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                                          boxed_match_priority=0, try_extract_without_anchor=False)]

    def extract(self, text: str) -> str | None:
        """The completion's answer as math-verify reads it, or None."""
        found = self._mv.parse(text, extraction_config=self._config, extraction_mode="first_match")
        return str(found[-1]) if found else None

    def reference_answer(self, reference: str) -> str:
        """The reference's answer as math-verify reads it (the reference whole where it reads none)."""
        found = self._mv.parse(reference)
        return str(found[-1]) if found else reference.strip()

    def scores(self, completions: Sequence[str], reference: str) -> list[float | None]:
        """1.0 / 0.0 for each completion; None each where the reference has no answer math-verify can parse."""
        gold = self._mv.parse(reference)
        if not gold:
            return [None] * len(completions)
        return [float(self._mv.verify(gold, self._mv.parse(text, extraction_config=self._config,
                                                           extraction_mode="first_match")))
                for text in completions]

    def judge(self, completions: Sequence[str], reference: str) -> list[bool]:
        """Whether each completion is correct (none is, against a reference it cannot parse)."""
        return [score == 1.0 for score in self.scores(completions, reference)]


def keep_correct(completions: Sequence[str], verdicts: Sequence[bool], limit: int | None = None,
                 distinct: str = "text") -> list[str]:
    """The correct completions, at most `limit` (None: all), in order, duplicates removed: `text` drops copies (up to
    surrounding white space); `equations` keeps one completion per equation list (`distinct_by_equations`)."""
    correct = [text for text, ok in zip(completions, verdicts, strict=True) if ok]
    if distinct == "equations":
        kept = distinct_by_equations(correct)
    else:
        first: dict[str, str] = {}
        for text in correct:
            first.setdefault(text.strip(), text)
        kept = list(first.values())
    return kept if limit is None else kept[:limit]


def equations(text: str) -> list[str]:
    """The calculator annotations of a GSM8K solution: the insides of its `<<...>>`, in order."""
    return _EQUATION.findall(text)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arithmetic(node: ast.AST) -> float:
    """The value of an expression of numbers and + - * / // % ** (what a calculator annotation holds); anything
    else raises ValueError. Python's eval, which ScRel uses, would run any code a model writes."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_arithmetic(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def check_equation(equation: str) -> bool:
    """Whether `lhs=rhs` holds: lhs evaluated is within 1e-3 of rhs (ScRel's `check_equation`; no '=' fails)."""
    if "=" not in equation:
        return False
    lhs, rhs = equation.split("=")[:2]
    try:
        return abs(float(_arithmetic(ast.parse(lhs.strip(), mode="eval"))) - float(rhs)) < 1e-3
    except (ValueError, SyntaxError, TypeError, ZeroDivisionError, OverflowError):
        return False


def equations_hold(text: str) -> bool:
    """Whether every calculator annotation of a completion holds (a completion without any passes)."""
    return all(check_equation(e) for e in equations(text))


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between two strings, in characters (what ScRel's `editdistance.eval` computes)."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, other in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (char != other))
    return row[-1]


def distinct_by_equations(completions: Sequence[str]) -> list[str]:
    """One completion per equation list, as ScRel's `collect`: the equations joined with spaces removed are a
    completion's key; a later completion with a key already kept replaces the kept one when its summed edit distance
    to the other kept completions is larger (the most different paths are kept). A completion with no equations is
    keyed by its text (ScRel keys them all alike, which keeps one such path per question: wrong for formats without
    calculator annotations)."""
    kept: list[str] = []
    keys: list[str] = []
    for text in completions:
        found = equations(text)
        key = "|".join(found).replace(" ", "") if found else "text:" + text.strip()
        if key not in keys:
            keys.append(key)
            kept.append(text)
            continue
        i = keys.index(key)
        others = [ref for ref in kept if ref != kept[i]]
        if sum(edit_distance(text, ref) for ref in others) > sum(edit_distance(kept[i], ref) for ref in others):
            kept[i] = text
    return kept
