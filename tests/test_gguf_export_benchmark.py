"""benchmarks/gguf_export_smollm2.py's table: accuracies as mean ± std over seeds, the largest Q4_1-vs-merged gap,
and the count of equal greedy generations."""

from __future__ import annotations

from conftest import load_benchmark


def test_the_table_reads_each_seeds_results():
    bench = load_benchmark("gguf_export_smollm2")
    rows = [{"seed": s, "prompts": 20, "generations_equal_f16": eq,
             "accuracy": {"base": 0.5, "merged": merged, "f16": merged, "q4_1": q}}
            for s, eq, merged, q in [(0, 20, 0.80, 0.795), (1, 19, 0.90, 0.88)]]
    header, _, line = bench.table(rows).splitlines()
    assert "GGUF Q4_1" in header
    assert line == "| 0, 1 | 50.0 ± 0.0 | 85.0 ± 7.1 | 85.0 ± 7.1 | 83.8 ± 6.0 | 2.0 | 20 + 19 of 40 |"
