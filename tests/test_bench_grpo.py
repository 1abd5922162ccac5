"""`xgblora bench --suite grpo --quick`: TRL's GRPOTrainer and xgblora's GRPO step alternate, every figure is
there and positive, and the table prints."""

import argparse
import json
import math

import pytest

from xgblora.bench import flags, suites


@pytest.mark.parametrize("data", ["generated", "gsm8k"])
def test_grpo_suite_quick_alternates_with_trl(data, tmp_path, request, capsys):
    """With --data_dir the prompts are GSM8K's questions; without, generated ones, and the suite says so. Each
    library checkpoints as it does by default (TRL on, xgblora off) unless --checkpointing sets both sides."""
    pytest.importorskip("trl")
    source = ["--data_dir", str(request.getfixturevalue("glue_data")), "--checkpointing", "on"] if data == "gsm8k" else []
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--quick", "--suite", "grpo", "--grpo_models", "tiny-llama", "--device", "cpu",
                              *source, "--skip_memory", "--json", str(tmp_path / "b.json")])
    assert suites.main(args) == 0
    printed = capsys.readouterr()
    assert ("no --data_dir: prompts are generated" in printed.err) == (not source)
    (case,) = json.loads((tmp_path / "b.json").read_text())["cases"]
    assert case["steps_timed"] == 2 and len(case["trl_step_s"]) == len(case["xgblora_step_s"]) == 2
    assert all(math.isfinite(case[k]) and case[k] > 0
               for k in ("xgblora_steps_per_s", "trl_steps_per_s", "speedup_vs_trl"))
    assert case["gradient_checkpointing"] == {"xgblora": bool(source), "trl": True}
    assert f"| tiny-llama | 1 x 2, 4 | {'on' if source else 'off'} / on |" in printed.out


def test_es_suite_quick_times_members_one_at_a_time_against_batched(tmp_path, capsys):
    """--suite es: the same ES run sampling its members one at a time and --es_member_batch at a time, steps
    alternating; both sample the same answers (the same losses every step), and the table prints."""
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--quick", "--suite", "es", "--grpo_models", "tiny-llama", "--device", "cpu",
                              "--json", str(tmp_path / "es.json")])
    assert suites.main(args) == 0
    (case,) = json.loads((tmp_path / "es.json").read_text())["cases"]
    assert (case["population"], case["member_batch"]) == (3, 2)  # --quick: batches of 2 and 1
    assert case["one_step_stats"]["n"] == case["batched_step_stats"]["n"] == 2
    assert case["same_rewards"] and case["losses"]["one"] == pytest.approx(case["losses"]["batched"], abs=1e-6)
    assert math.isfinite(case["speedup"]) and case["speedup"] > 0
    assert "| tiny-llama | 1 x 2, 4 | 3, 2 |" in capsys.readouterr().out
