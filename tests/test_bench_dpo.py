"""`xgblora bench --suite dpo|kto|reward --quick`: TRL's DPOTrainer, KTOTrainer or RewardTrainer and xgblora's step
alternate on the same pairs (or rows), every figure is there and positive, and the table prints."""

import argparse
import json
import math

import pytest

from xgblora.bench import flags, suites


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["dpo", "kto", "reward"])
def test_preference_suite_quick_alternates_with_trl(tmp_path, capsys, suite):
    pytest.importorskip("trl")
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    both = "off" if suite == "reward" else "default"  # off on both sides, or each library's own
    args = parser.parse_args(["--quick", "--suite", suite, "--dpo_models", "tiny-llama", "--device", "cpu",
                              "--checkpointing", both, "--skip_memory", "--json", str(tmp_path / "b.json")])
    assert suites.main(args) == 0
    (case,) = json.loads((tmp_path / "b.json").read_text())["cases"]
    assert case["steps_timed"] == 2 and len(case["trl_step_s"]) == len(case["xgblora_step_s"]) == 2
    assert all(math.isfinite(case[k]) and case[k] > 0
               for k in ("xgblora_steps_per_s", "trl_steps_per_s", "speedup_vs_trl"))
    assert case["gradient_checkpointing"] == {"xgblora": False, "trl": both == "default"}
    assert f"| tiny-llama | 2, 8 + 2 x 4 | off / {'on' if both == 'default' else 'off'} |" in capsys.readouterr().out
