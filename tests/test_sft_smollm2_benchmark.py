"""benchmarks/sft_smollm2.py's two readings of an answer: GSM8K's `#### N` line and the reply's last number."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_scores_read_the_answer_line_and_the_last_number(tmp_path):
    bench = load_benchmark("sft_smollm2")
    rows = [("3 + 4 = 7\n#### 7", "#### 7"),            # both readings right
            ("It is 7.", "3 + 4 = 7\n#### 7"),           # no answer line: only the last number is right
            ("#### 1,250\nso 1250 it is", "#### 1250"),  # the answer line wins; its comma is read
            ("#### 8 then 7", "#### 7"),                  # the answer line says 8: wrong; the last number, 7
            ("nothing", "#### 7")]                        # neither
    (tmp_path / "predictions.jsonl").write_text(
        "".join(json.dumps({"prediction": p, "reference": r}) + "\n" for p, r in rows))
    assert bench.scores(tmp_path) == {"####": 2 / 5, "last number": 4 / 5}
