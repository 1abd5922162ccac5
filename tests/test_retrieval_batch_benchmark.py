"""benchmarks/retrieval_batch.py's splits: every row's document is its own (a MultiRC question's paragraph, an RTE
hypothesis's premise), the dev split holds out whole training documents, and test comes from the validation split,
less the documents trained on (RTE repeats premises across its splits)."""

from __future__ import annotations

import pytest
from conftest import load_benchmark


@pytest.mark.parametrize("task", ["multirc", "rte"])
def test_splits_hold_out_whole_documents(task, tmp_path, glue_data):
    bench = load_benchmark("retrieval_batch")
    files = bench.write_splits(glue_data, tmp_path, 10, task)
    rows = {name: bench.rows_of(path) for name, path in files.items()}
    documents = {name: {r["positive"] for r in split} for name, split in rows.items()}

    assert documents["train"].isdisjoint(documents["dev"])
    assert documents["train"].isdisjoint(documents["test"])
    assert len(rows["test"]) == 10
    assert len(rows["dev"]) >= len(rows["train"]) // 20  # about a tenth of the documents, with their queries
    if task == "rte":
        rte = [r for source in ("train", "dev") for r in bench.rows_of(glue_data / "rte" / f"{source}.jsonl")]
        own = {(r["hypothesis"], r["premise"]) for r in rte}
        assert all((r["query"], r["positive"]) in own for split in rows.values() for r in split)
        validation = {r["premise"] for r in bench.rows_of(glue_data / "rte" / "dev.jsonl")}
        assert documents["test"] <= validation
