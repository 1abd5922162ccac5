"""benchmarks/restructure_check.py: two revisions' bench ratios side by side, each revision run from its own src/."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import BENCHMARKS, load_benchmark

check = load_benchmark("restructure_check")


def test_a_revision_runs_from_its_own_copy_of_src(tmp_path):
    src = check.source_tree("HEAD", tmp_path)
    committed = subprocess.run(["git", "-C", str(check.REPO), "show", "HEAD:src/xgblora/cli.py"],
                               capture_output=True, text=True, check=True).stdout
    assert (src / "xgblora" / "cli.py").read_text() == committed
    check.check_imports_from(src)  # PYTHONPATH puts this copy ahead of the installed package
    assert check.source_tree(".", tmp_path) == check.REPO / "src"


def test_the_table_holds_each_run_and_the_ratio_of_the_means():
    before = [check.ratios({"zo_step_over_two_forwards": 1.2, "fo_lora_speedup_vs_hf_peft": 1.1}),
              check.ratios({"zo_step_over_two_forwards": 1.0, "fo_lora_speedup_vs_hf_peft": 1.3})]
    after = [check.ratios({"zo_step_over_two_forwards": 0.9, "fo_lora_speedup_vs_hf_peft": 1.2}),
             check.ratios({"zo_step_over_two_forwards": 1.3, "fo_lora_speedup_vs_hf_peft": None})]
    assert math.isnan(after[1]["fo_lora_speedup_vs_hf_peft"]) and math.isnan(before[0]["eval_speedup_vs_per_candidate"])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in check.table(("old", "new"), before, after).splitlines()}
    zo = rows["MeZO LoRA step / two forwards (lower)"].split(" | ")
    assert zo[1:4] == ["1.200, 1.000", "0.900, 1.300", "1.100 / 1.100"] and zo[4].startswith("1.000")
    adamw = rows["AdamW LoRA speed-up vs HF Trainer + PEFT (higher)"].split(" | ")
    assert adamw[3] == "1.200 / 1.200"  # a run that reported no figure leaves the mean of the others


def test_flags_after_the_separator_go_to_the_bench():
    assert check.split_bench_flags(["abc", "--runs", "2", "--", "--quick", "--repeats", "3"]) == (
        ["abc", "--runs", "2"], ["--quick", "--repeats", "3"])
    assert check.split_bench_flags(["abc", "def"]) == (["abc", "def"], [])


@pytest.mark.slow
def test_two_revisions_run_in_turn_and_the_table_shows_their_figures(tmp_path):
    out = subprocess.run([sys.executable, str(BENCHMARKS / "restructure_check.py"), "HEAD", ".", "--runs", "1",
                          "--out", str(tmp_path), "--", "--quick", "--skip_hf"],
                         capture_output=True, text=True, check=True).stdout
    figures = {side: json.loads((tmp_path / f"{side}-1.json").read_text()) for side in ("before", "after")}
    row = next(line for line in out.splitlines() if line.startswith("| MeZO LoRA step / two forwards"))
    cells = row.split(" | ")
    assert cells[1] == f"{figures['before']['zo_step_over_two_forwards']:.3f}"
    assert cells[2] == f"{figures['after']['zo_step_over_two_forwards']:.3f}"
