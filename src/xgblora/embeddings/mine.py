"""`xgblora mine`: hard negatives for a pair file, mined with an embedding model, written as a pair file that
`xgblora train --objective contrastive` reads (rows of query, positive and a list `negatives`).

For each distinct query, every document of the corpus (the file's distinct positives, plus `--corpus` texts) is
ranked by cosine similarity. A query's own positives (every row's positive for that query text) are never
candidates. A document scoring within a margin of the query's positive (`absolute_margin`: above positive - m;
`relative_margin`: above positive - |positive| x m, the hardest positive when a query has several), above
`max_score` or below `min_score` is dropped; ranks then count the documents left from 1, and the candidates are
ranks range_min + 1 .. range_max (a window that skips the very top, where unlabelled positives sit), as
sentence-transformers' `mine_hard_negatives` counts them; the first `num_negatives` candidates (`top`) or a seeded
random draw of them (`random`) are the row's negatives, most similar first. The output never replaces an existing file.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from xgblora import atomic
from xgblora.checkpoint import run_config
from xgblora.data.sources import parse_columns, read_rows
from xgblora.data.tasks import Fields
from xgblora.embeddings.encode import EncodeOptions, load_encoder
from xgblora.embeddings.pooling import encode_texts
from xgblora.errors import UserError
from xgblora.models import pretrained

log = logging.getLogger("xgblora")

@dataclass
class MineOptions:
    """What `xgblora mine` was asked for."""

    model: str
    input_file: str
    output_file: str
    columns: str | None = None
    corpus: str | None = None
    corpus_column: str = "text"
    num_negatives: int = 1
    range_min: int = 0
    range_max: int = 50
    absolute_margin: float | None = None
    relative_margin: float | None = 0.05
    max_score: float | None = None
    min_score: float | None = None
    sampling: str = "top"
    seed: int = 0
    max_length: int | None = None
    batch_size: int = 64
    device: str = "auto"
    trust_remote_code: bool = False


@dataclass(frozen=True)
class Window:
    """Which ranked documents may become negatives (see the module docstring)."""

    range_min: int = 0
    range_max: int = 50
    absolute_margin: float | None = None
    relative_margin: float | None = None
    max_score: float | None = None
    min_score: float | None = None

    def allows(self, score: float, positive: float) -> bool:
        """Whether a document of this score may be a negative of a query whose (hardest) positive scores `positive`."""
        return not ((self.absolute_margin is not None and score > positive - self.absolute_margin)
                    or (self.relative_margin is not None and score > positive - abs(positive) * self.relative_margin)
                    or (self.max_score is not None and score > self.max_score)
                    or (self.min_score is not None and score < self.min_score))


def mine(queries: Tensor, corpus: Tensor, positives: Sequence[Sequence[int]], window: Window, num_negatives: int,
         sampling: str = "top", seed: int = 0) -> list[list[int]]:
    """Corpus indices of each query's negatives, most similar first, from unit embeddings, as sentence-transformers'
    `mine_hard_negatives` picks them: of the range_max + (most positives of a query) most similar documents, the
    query's positives and what the window's margins and score bounds rule out are dropped; ranks range_min + 1 ..
    range_max of what is left are the candidates (so range_min counts after the filters, not before).

    positives[i]: the corpus indices of query i's positives, one per row (never negatives; the hardest sets the
    margin).
    """
    draw = random.Random(seed)
    pool = min(window.range_max + max(map(len, positives), default=0), corpus.shape[0])
    chosen: list[list[int]] = []
    for start in range(0, queries.shape[0], 1024):  # [1024, corpus] scores at a time
        scores = queries[start:start + 1024] @ corpus.T
        for row, own in zip(scores, positives[start:start + 1024], strict=True):
            positive = float(row[list(own)].min())
            top, where = row.topk(pool)
            left = [i for s, i in zip(top.tolist(), where.tolist(), strict=True)
                    if i not in own and window.allows(s, positive)]
            kept = left[:window.range_max][window.range_min:]
            if sampling == "random" and len(kept) > num_negatives:
                kept = sorted(draw.sample(kept, num_negatives), key=kept.index)
            chosen.append(kept[:num_negatives])
    return chosen


def _doc_prefix(model: str) -> str:
    """A trained run's --doc_instruction ('' for any other model)."""
    return (run_config(Path(model)).get("doc_instruction") or "") if (Path(model) / "config.yaml").is_file() else ""


def _check(opts: MineOptions) -> Path:
    atomic.check_path(opts.output_file, "--output_file")
    out = Path(opts.output_file)
    if out.suffix != ".jsonl":
        raise UserError(f"--output_file {out}: name a .jsonl file (rows of query, positive, negatives)")
    if out.exists():
        raise UserError(f"--output_file {out}: exists; choose a new file name (xgblora does not overwrite your files)")
    if opts.num_negatives < 1 or opts.range_min < 0 or opts.range_max <= opts.range_min:
        raise UserError(f"need --num_negatives >= 1 and 0 <= --range_min < --range_max, got {opts.num_negatives}, "
                        f"{opts.range_min}, {opts.range_max}")
    if opts.sampling not in ("top", "random"):
        raise UserError(f"--sampling must be top or random, got {opts.sampling!r}")
    atomic.check_writable(out, "--output_file")
    return out


def _check_window(opts: MineOptions) -> None:
    """The rank window, margins and score bounds: refused where they leave no candidate for any corpus (scores are
    cosine similarities, in [-1, 1]); a window narrower than --num_negatives as mine_hard_negatives refuses it."""
    if opts.num_negatives > opts.range_max - opts.range_min:
        raise UserError(f"--num_negatives {opts.num_negatives}: only {opts.range_max - opts.range_min} candidates "
                        f"remain after skipping the first --range_min {opts.range_min} of --range_max "
                        f"{opts.range_max}; lower --num_negatives or --range_min, or raise --range_max")
    for name in ("absolute_margin", "relative_margin"):
        if (value := getattr(opts, name)) is not None and value < 0:
            raise UserError(f"--{name} must be 0 or more (how far below the positive a document must score), got "
                            f"{value}")
    if opts.absolute_margin is not None and opts.absolute_margin > 2:
        raise UserError(f"--absolute_margin {opts.absolute_margin}: cosine similarities lie in [-1, 1], so no document "
                        f"scores more than 2 below the positive and every candidate would be dropped; pass 2 or less")
    if opts.min_score is not None and opts.max_score is not None and opts.min_score > opts.max_score:
        raise UserError(f"--min_score {opts.min_score} is above --max_score {opts.max_score}: no score lies between "
                        f"them, so every candidate would be dropped")


def _warn_small_corpus(num_negatives: int, corpus: Sequence[str], own: dict[str, list[int]]) -> None:
    """Say, before the model loads, when no query can get --num_negatives negatives: rows get what there is, as
    mine_hard_negatives gives them (it says afterwards how many fell short; results say it too)."""
    most = len(corpus) - min((len(set(p)) for p in own.values()), default=0)
    if num_negatives > most:
        log.warning("--num_negatives %d: the corpus holds %d documents, so a query has at most %d that are not its "
                    "own positives; every row gets fewer (add documents with --corpus)", num_negatives, len(corpus),
                    most)


def mine_file(opts: MineOptions) -> dict[str, Any]:
    """Mine negatives for every row of --input and write them to --output; returns what was done."""
    out = _check(opts)
    _check_window(opts)
    pretrained.choose_device(opts.device)  # a device this machine lacks: said before the model loads
    rows = [Fields(row, where) for where, row in read_rows(opts.input_file, columns=parse_columns(opts.columns))]
    pairs = [(r.text("query"), r.text("positive")) for r in rows]
    extra = [Fields(row, where).text(opts.corpus_column) for where, row in read_rows(opts.corpus)] \
        if opts.corpus else []
    corpus = list(dict.fromkeys([p for _, p in pairs] + extra))
    where = {d: i for i, d in enumerate(corpus)}
    queries = list(dict.fromkeys(q for q, _ in pairs))
    own: dict[str, list[int]] = {q: [] for q in queries}
    for q, p in pairs:
        own[q].append(where[p])
    _warn_small_corpus(opts.num_negatives, corpus, own)
    model, tokenizer, settings = load_encoder(EncodeOptions(model=opts.model, input_file=opts.input_file,
                                                            output_file=opts.output_file,
                                                            max_length=opts.max_length, device=opts.device,
                                                            trust_remote_code=opts.trust_remote_code))
    encode = dict(pooling=settings["pooling"], max_length=int(settings["max_length"]), batch_size=opts.batch_size,
                  bidirectional=settings["bidirectional"])
    q_vectors = encode_texts(model, tokenizer, queries, prefix=settings["prefix"], **encode)
    c_vectors = encode_texts(model, tokenizer, corpus, prefix=_doc_prefix(opts.model), **encode)
    window = Window(opts.range_min, opts.range_max, opts.absolute_margin, opts.relative_margin, opts.max_score,
                    opts.min_score)
    found = dict(zip(queries, mine(q_vectors, c_vectors, [own[q] for q in queries], window, opts.num_negatives,
                                   opts.sampling, opts.seed), strict=True))
    written = [{"query": q, "positive": p, **({"negatives": [corpus[i] for i in found[q]]} if found[q] else {})}
               for q, p in pairs]
    if not atomic.create_text(out, atomic.jsonl(written)):
        raise UserError(f"--output_file {out}: exists; choose a new file name (xgblora does not overwrite your files)")
    short = sum(len(found[q]) < opts.num_negatives for q, _ in pairs)
    return {"output": str(out), "rows": len(pairs), "queries": len(queries), "corpus_size": len(corpus),
            "negatives": sum(len(found[q]) for q, _ in pairs), "rows_short_of_num_negatives": short}
