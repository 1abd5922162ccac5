"""Read a user's data file, folder or dataset id into rows, with the user's column names mapped to ours.

JSONL (and .json holding one object per line, or one array of objects) is parsed here, so that an error names the
file, the line (or row) and the field. Every other source goes through `datasets`: CSV/TSV, parquet, arrow, a
`save_to_disk` folder, a folder of data files, or a dataset id on the hub (`datasets.load_dataset`, which works
offline for local files). Their errors name the row (1-based) and the column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xgblora.errors import UserError, located

Where = tuple[str, int | str | None]  # (file or dataset, line number or "row N") that a row came from

_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
_BUILDERS = {".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}), ".parquet": ("parquet", {}),
             ".arrow": ("arrow", {})}
_EVAL_SPLITS = ("validation", "valid", "dev", "test", "eval")


def parse_columns(spec: str | None) -> dict[str, str]:
    """'--columns prompt=question,completion=answer' -> {"question": "prompt", "answer": "completion"}."""
    if not spec:
        return {}
    renames = {}
    for item in spec.split(","):
        ours, sep, theirs = (part.strip() for part in item.partition("="))
        if not sep or not ours or not theirs:
            raise UserError(f"--columns {spec!r}: {item.strip()!r} is not OURS=THEIRS (e.g. prompt=question)")
        if theirs in renames:
            raise UserError(f"--columns {spec!r}: column {theirs!r} is mapped twice")
        renames[theirs] = ours
    return renames


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) for every non-blank line of a JSONL file; bad input raises a one-line UserError.

    We parse JSONL ourselves instead of with datasets' "json" loader: that loader cannot say which line and
    field of a file is bad, and it infers one column type across rows, so a stray label type fails far away.
    """
    data = _read_bytes(path)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise located(path, 1, None, "UTF-16 text (it starts with a UTF-16 byte-order mark); save the file as UTF-8")
    rows = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:  # utf-8-sig: a UTF-8 byte-order mark may start the file, or any line of files joined with cat
            line = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            bad = f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
            raise located(path, number, None, f"not UTF-8 text ({bad}); save the file as UTF-8") from None
        if line.strip():
            rows.append((number, _json_object(path, number, line)))
    if not rows:
        raise UserError(f"{path}: empty file (no JSON lines)")
    return rows


def _read_bytes(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _json_object(path: Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise located(path, number, None, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # valid syntax Python cannot hold, e.g. an integer over the 4300-digit limit
        raise located(path, number, None, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise located(path, number, None, "not valid JSON (arrays or objects nested too deeply)") from None
    if not isinstance(row, dict):
        raise located(path, number, None, f"expected a JSON object, got {_JSON_TYPES.get(type(row), 'null')}")
    return row


def read_rows(source: str, split: str = "train", columns: dict[str, str] | None = None) -> list[tuple[Where, dict]]:
    """Every row of a file, folder or dataset id, as (where it came from, row with the mapped column names).

    split: 'train' or 'eval', the split taken from a source that holds several (a DatasetDict folder, a hub id).
    """
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".json" and _is_json_array(path):
        rows: list[tuple[Where, dict]] = _json_array_rows(path)
    elif path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
        rows = [((str(path), n), row) for n, row in read_jsonl(path)]
    else:
        rows = [((source, f"row {i}"), row) for i, row in enumerate(_load_dataset(source, split), 1)]
        if not rows:
            raise UserError(f"{source}: no rows")
    return [(where, _rename(row, columns, where)) for where, row in rows] if columns else rows


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _json_array_rows(path: Path) -> list[tuple[Where, dict]]:
    """The objects of a .json file holding one array (parsed here, not by pyarrow, which can crash on bad input)."""
    try:
        values = json.loads(_read_bytes(path).decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; save the file as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise located(path, exc.lineno, None, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{path}: not valid JSON ({type(exc).__name__})") from None
    if not isinstance(values, list) or not values:
        raise UserError(f"{path}: expected a non-empty JSON array of objects")
    rows = []
    for i, value in enumerate(values, 1):
        if not isinstance(value, dict):
            raise located(path, f"row {i}", None, f"expected a JSON object, got {_JSON_TYPES.get(type(value), 'null')}")
        rows.append(((str(path), f"row {i}"), value))
    return rows


def _rename(row: dict, columns: dict[str, str], where: Where) -> dict:
    missing = [theirs for theirs in columns if theirs not in row]
    if missing:
        raise located(where[0], where[1], missing[0], f"missing (--columns maps it to {columns[missing[0]]!r}); "
                      f"the row has: {', '.join(map(str, row)) or 'no fields'}")
    return {columns.get(key, key): value for key, value in row.items()}


def _load_dataset(source: str, split: str) -> list[dict[str, Any]]:
    """Rows of a non-JSONL source through `datasets`."""
    import datasets  # slow to import; JSONL does without it

    path = Path(source)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # stderr stays one line when the file is bad
    try:
        if path.is_dir() and any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file():
            if path.suffix.lower() not in _BUILDERS:
                raise UserError(f"{source}: unknown file type {path.suffix!r}; use .jsonl, .json, .csv, .tsv, "
                                f".parquet or .arrow, a save_to_disk folder or a dataset id")
            builder, options = _BUILDERS[path.suffix.lower()]
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
        elif path.suffix.lower() in (*_BUILDERS, ".jsonl", ".json") or source.startswith((".", "/", "~")):
            raise UserError(f"{source}: no such file")
        else:  # a folder of data files or a dataset id (the hub, or its cache when offline)
            loaded = datasets.load_dataset(source)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 -- parse errors, offline hub, not found...: all mean "cannot load"
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{source}: cannot load with datasets ({type(exc).__name__}: {first})") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    return _pick_split(loaded, source, split).to_list()


def _pick_split(loaded: Any, source: str, split: str) -> Any:
    """A DatasetDict's 'train' split for training, its validation/dev/test split for evaluation."""
    if not hasattr(loaded, "keys"):
        return loaded
    wanted = ("train",) if split == "train" else _EVAL_SPLITS
    found = next((name for name in wanted if name in loaded), None)
    if found is None:
        raise UserError(f"{source}: no {' or '.join(wanted)} split (it has: {', '.join(loaded)})")
    return loaded[found]
