"""Checks of option values that any options dataclass can use: finite numbers, choices, seeds, positive values,
output paths, sampling ranges, Matryoshka sizes; each a one-line UserError naming the flag."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from xgblora import atomic
from xgblora.errors import UserError
from xgblora.options import SamplingOptions

# Options naming where a command writes: none may be empty (Path("") is the working directory, which the command would
# then write into, over files of the same names)
OUTPUT_PATHS = ("output_dir", "output_root", "output_file", "loss_figure_path", "result_file")


def check_output_paths(cfg: Any) -> None:
    """One-line errors for an empty output path, for any options dataclass."""
    for name in OUTPUT_PATHS:
        if hasattr(cfg, name):
            atomic.check_path(getattr(cfg, name), f"--{name}")


def check_finite(cfg: Any) -> None:
    """One-line errors for numbers that are nan or infinite: no option has a meaning for them, and a comparison with
    nan is always false, so a range check alone lets it through."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise UserError(f"--{f.name} must be a finite number, got {item}")


def check_choices(cfg: Any) -> None:
    """One-line errors for options outside their choices, for any options dataclass (None where it is the default:
    the option's value then depends on others)."""
    for f in dataclasses.fields(cfg):
        choices, value = f.metadata.get("choices"), getattr(cfg, f.name)
        if choices and value not in choices and not (value is None and f.default is None):
            raise UserError(f"--{f.name} {value!r}: choose one of {', '.join(choices)}")


def check_sampling(cfg: SamplingOptions, samples: int = 1) -> None:
    """One-line errors for sampling options out of range; `samples`: the completions drawn per prompt."""
    check_positive(cfg, "max_batch_tokens")
    if samples < 1:
        raise UserError(f"--num_return_sequences must be positive, got {samples}")
    if cfg.temperature < 0:
        raise UserError(f"--temperature must be 0 (greedy) or more, got {cfg.temperature}")
    if not 0.0 < cfg.top_p <= 1.0:
        raise UserError(f"--top_p must be in (0, 1], got {cfg.top_p}")
    if samples > 1 and cfg.temperature == 0:
        raise UserError(f"--num_return_sequences {samples} with --temperature 0 would return the same greedy "
                        f"completion {samples} times; set a temperature")


def check_seeds(cfg: Any, *names: str) -> None:
    """One-line errors for seeds outside what torch and numpy take, [0, 2**32 - 1] (a list: each of its values)."""
    for name in names:
        value = getattr(cfg, name)
        for seed in value if isinstance(value, list) else [value]:
            if not 0 <= seed < 2**32:
                raise UserError(f"--{name} must be between 0 and 2**32 - 1, got {seed}")


def parse_matryoshka(dims: str | None, weights: str | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """'384,256,128,64' (commas or spaces) and its weights (default 1 each) -> (dims, weights), refused in one line
    where sentence-transformers' MatryoshkaLoss would fail or silently count a size twice."""
    if dims is None:
        if weights is not None:
            raise UserError("--matryoshka_weights weighs the losses of --matryoshka_dims; pass --matryoshka_dims too")
        return (), ()
    parsed = tuple(_matryoshka_dim(dims, token) for token in dims.replace(",", " ").split())
    if not parsed:
        raise UserError(f"--matryoshka_dims {dims!r} names no size: give embedding sizes, e.g. 384,256,128,64")
    repeated = sorted({d for d in parsed if parsed.count(d) > 1})
    if repeated:
        raise UserError(f"--matryoshka_dims {dims!r}: {repeated[0]} is given twice; give each size once (weigh it "
                        f"with --matryoshka_weights)")
    if weights is None:
        return parsed, (1.0,) * len(parsed)
    values = tuple(_matryoshka_weight(weights, token) for token in weights.replace(",", " ").split())
    if len(values) != len(parsed):
        raise UserError(f"--matryoshka_weights {weights!r}: {len(values)} weights for {len(parsed)} "
                        f"--matryoshka_dims sizes; give one per size")
    return parsed, values


def _matryoshka_dim(dims: str, token: str) -> int:
    try:
        value = int(token)
    except ValueError:
        value = 0
    if value <= 0:
        raise UserError(f"--matryoshka_dims {dims!r}: {token!r} is not a positive whole number of dimensions")
    return value


def _matryoshka_weight(weights: str, token: str) -> float:
    try:
        value = float(token)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UserError(f"--matryoshka_weights {weights!r}: {token!r} is not a weight of 0 or more")
    return value


def check_positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default value."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()
