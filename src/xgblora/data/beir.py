"""BEIR-format retrieval files: corpus.jsonl (_id, title, text), queries.jsonl (_id, text) and a qrels TSV
(query-id, corpus-id, score, under a header line), read as sentence-transformers' InformationRetrievalEvaluator
takes them: a document is its title and text joined by a space (as BEIR embeds it), a judgement with a score above
0 makes the document relevant, and a query without a relevant document is not scored. Bad input is one line
naming the file, the line and the field."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xgblora.data.sources import read_jsonl
from xgblora.errors import UserError, located

QRELS_COLUMNS = ("query-id", "corpus-id", "score")


@dataclass(frozen=True)
class RetrievalSet:
    """A corpus, the queries that have a relevant document in it (in their file's order), and those documents."""

    corpus: dict[str, str]  # document id -> its text (title and text)
    queries: dict[str, str]  # query id -> its text
    relevant: dict[str, set[str]]  # query id -> the ids of its relevant documents


def read_retrieval_set(corpus_file: Path, queries_file: Path, qrels_file: Path) -> RetrievalSet:
    """The three files read and checked against each other (every judgement names a document and a query)."""
    corpus = _texts(corpus_file, title=True)
    queries = _texts(queries_file, title=False)
    relevant: dict[str, set[str]] = {}
    for line, query, document, score in _judgements(qrels_file):
        if query not in queries:
            raise located(qrels_file, line, "query-id", f"{query!r} is no _id of {queries_file}")
        if document not in corpus:
            raise located(qrels_file, line, "corpus-id", f"{document!r} is no _id of {corpus_file}")
        if score > 0:
            relevant.setdefault(query, set()).add(document)
    scored = {qid: text for qid, text in queries.items() if qid in relevant}
    if not scored:
        raise UserError(f"{qrels_file}: no query has a relevant document (a judgement with a score above 0)")
    return RetrievalSet(corpus, scored, relevant)


def _texts(path: Path, title: bool) -> dict[str, str]:
    """id -> text of a corpus (title and text joined, as BEIR does) or queries file, each id once."""
    out: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line, row in read_jsonl(path):
        key = _id(path, line, row)
        if key in out:
            raise located(path, line, "_id", f"{key!r} is also the _id of line {first_line[key]}; give each row its own")
        text = _string(path, line, row, "text")
        heading = _string(path, line, row, "title") if title and row.get("title") is not None else ""
        out[key], first_line[key] = f"{heading} {text}".strip() if title else text, line
    return out


def _id(path: Path, line: int, row: dict[str, Any]) -> str:
    value = row.get("_id")
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        what = "missing" if value is None else f"expected a string id, got {value!r}"
        raise located(path, line, "_id", f"{what}; the row has: {', '.join(map(str, row)) or 'no fields'}")
    return str(value)


def _string(path: Path, line: int, row: dict[str, Any], field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        what = "missing" if field not in row else f"expected a string, got {type(value).__name__}"
        raise located(path, line, field, f"{what}; the row has: {', '.join(map(str, row)) or 'no fields'}")
    return value


def _judgements(path: Path) -> list[tuple[int, str, str, float]]:
    """(line, query id, document id, score) of each row of a qrels TSV after its header line."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read ({exc.__class__.__name__}: {exc})") from None
    rows = [(n, row) for n, row in enumerate(csv.reader(io.StringIO(text), delimiter="\t"), 1) if any(row)]
    if not rows:
        raise UserError(f"{path}: empty file (BEIR's qrels: a header line, then query-id, corpus-id, score rows)")
    header = rows[0][1]
    if len(header) == len(QRELS_COLUMNS) and _number(header[2]) is not None:
        raise located(path, 1, None, f"a judgement where the header ({', '.join(QRELS_COLUMNS)}) belongs; BEIR's "
                                     f"qrels start with it, and the first line is skipped")
    out = []
    for line, row in rows[1:]:
        if len(row) != len(QRELS_COLUMNS):
            raise located(path, line, None, f"{len(row)} tab-separated fields; expected 3: "
                                            f"{', '.join(QRELS_COLUMNS)}")
        score = _number(row[2])
        if score is None:
            raise located(path, line, "score", f"{row[2]!r} is not a number")
        out.append((line, row[0], row[1], score))
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
