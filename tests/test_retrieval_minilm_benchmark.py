"""benchmarks/retrieval_minilm.py's data building: the BEIR folder it writes reads back through xgblora's own
reader, and no test document (premise) is a training document."""

from __future__ import annotations

import json

from conftest import load_benchmark

from xgblora.data.beir import read_retrieval_set


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_the_beir_set_reads_back_and_its_documents_are_never_trained_on(tmp_path):
    data = tmp_path / "data"
    row = lambda p, h, label=0: {"premise": p, "hypothesis": h, "label": label}  # noqa: E731
    _write(data / "rte" / "train.jsonl", [row("P1", "H1"), row("P1", "H1b", 1), row("P2", "H2"), row("shared", "Hs")])
    _write(data / "rte" / "dev.jsonl", [row("P3", "H3"), row("P3", "H3b"), row("P4", "H4", 1), row("shared", "Hx"),
                                        row("P5", "H3")])  # H3 twice: one query, two relevant premises
    files = load_benchmark("retrieval_minilm").build(data, tmp_path / "out")
    beir = files["beir"]
    test = read_retrieval_set(beir / "corpus.jsonl", beir / "queries.jsonl", beir / "qrels" / "test.tsv")
    assert sorted(test.corpus.values()) == ["P3", "P4", "P5"]  # "shared" is a training premise: left out
    assert sorted(test.queries.values()) == ["H3", "H3b", "H4"]
    by_text = {text: key for key, text in test.corpus.items()}
    h3 = next(key for key, text in test.queries.items() if text == "H3")
    assert test.relevant[h3] == {by_text["P3"], by_text["P5"]}
    train = [json.loads(line) for line in files["train"].read_text().splitlines()]
    assert {r["positive"] for r in train} == {"P1", "P2", "shared"}
    assert not {r["positive"] for r in train} & set(test.corpus.values())


def test_the_table_gives_the_rerankers_gain_over_the_first_stages_top_k_at_each_size():
    bench = load_benchmark("retrieval_minilm")
    rows = [{"run": "reranker", "seed": seed, "top_k": 20, **{
        f"ndcg@10 {when} rerank dim {size}": value + seed / 100 for size, when, value in (
            (384, "before", 0.9), (384, "after", 0.95), (64, "before", 0.8), (64, "after", 0.9))}}
            for seed in (0, 1)]
    table = bench.summarise(rows)
    assert "| first stage at its whole embedding (384) | 2 | 90.5 ± 0.7 | 95.5 ± 0.7 | 5.0 ± 0.0 |" in table
    assert "| first stage at its first 64 dimensions (--truncate_dim 64) | 2 | 80.5 ± 0.7 | 90.5 ± 0.7 | 10.0 ± 0.0 |" \
        in table
