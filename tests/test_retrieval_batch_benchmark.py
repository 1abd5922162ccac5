"""benchmarks/retrieval_batch.py's splits: every row's document is its own (a MultiRC question's paragraph, an RTE
hypothesis's premise), the dev split holds out whole training documents, and test comes from the validation split,
less the documents trained on (RTE repeats premises across its splits)."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark


def read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("task", ["multirc", "rte"])
def test_splits_hold_out_whole_documents(task, tmp_path, shared_data):
    bench = load_benchmark("retrieval_batch")
    data = shared_data
    files = bench.write_splits(data, tmp_path, 50, task)
    rows = {name: read(path) for name, path in files.items()}
    documents = {name: {r["positive"] for r in split} for name, split in rows.items()}

    assert documents["train"].isdisjoint(documents["dev"])
    assert documents["train"].isdisjoint(documents["test"])
    assert len(rows["test"]) == 50
    assert len(rows["dev"]) >= len(rows["train"]) // 20  # about a tenth of the documents, with their queries
    if task == "rte":
        own = {(r["hypothesis"], r["premise"]) for source in ("train", "dev") for r in read(data / "rte" /
                                                                                           f"{source}.jsonl")}
        assert all((r["query"], r["positive"]) in own for split in rows.values() for r in split)
        validation = {r["premise"] for r in read(data / "rte" / "dev.jsonl")}
        assert documents["test"] <= validation
