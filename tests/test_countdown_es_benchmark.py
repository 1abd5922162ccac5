"""benchmarks/countdown_es.py's xgblora side on the tiny random model against a stand-in reference checkout (its
grader and question file; the reference itself is not vendored): the run lands one row per iteration and one for
the run, the flags carry the reference's population, sigma and alpha, the reward grades prompt + completion as the
reference does, and the table reads the rows."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

from xgblora.logs import MetricsLog

# The stand-in grader: format 0.1 when "<answer>" appears, 1 more when the answer is the target (the reference's
# reward_function(response, numbers, target) -> {"reward": ...} shape).
GRADER = '''
def reward_function(response, numbers=None, target=None):
    answer = response.split("<answer>")[-1].split("</answer>")[0].strip() if "<answer>" in response else None
    return {"reward": 0.1 * ("<answer>" in response) + (answer == str(target))}
'''


@pytest.fixture
def reference(tmp_path, monkeypatch):
    (tmp_path / "ref" / "countdown" / "data").mkdir(parents=True)
    (tmp_path / "ref" / "countdown" / "countdown_task.py").write_text(GRADER)
    rows = [{"context": f"Using [{a} {b}] make {a + b}. Think in <think> </think>, answer in <answer> </answer>.",
             "numbers": [a, b], "target": a + b} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    (tmp_path / "ref" / "countdown" / "data" / "countdown.json").write_text(json.dumps(rows))
    monkeypatch.setattr(MetricsLog, "log", MetricsLog.log)  # the run wraps it: restored after the test
    monkeypatch.setenv("COUNTDOWN_REF_DIR", str(tmp_path / "ref"))
    return tmp_path / "ref"


@pytest.mark.parametrize("side", ["lora", "lora-batched"])
def test_the_xgblora_side_lands_its_iterations_and_its_run(reference, tmp_path, monkeypatch, side):
    bench = load_benchmark("countdown_es")
    monkeypatch.syspath_prepend(str(bench.HERE))
    args = bench.parse_args(["--ref_dir", str(reference), "--out", str(tmp_path / "out"), "--model", "tiny-llama",
                             "--iterations", "2", "--population", "4", "--train_questions", "2",
                             "--max_new_tokens", "4", "--member_batch", "3", "--_side", side, "--_seed", "0"])
    out = tmp_path / "out"
    out.mkdir()
    bench.run_side(args)  # as the script's own process for the side runs it
    rows = bench.read_rows(out)
    assert [(r["kind"], r.get("iteration")) for r in rows] == [("iteration", 1), ("iteration", 2), ("run", None)]
    assert all(r["mean_reward"] is not None and r["cpu_s"] > 0 for r in rows[:2])
    assert (out / "seed0" / side / "run" / "final").is_dir()
    assert f"| {side} | 0.05 / 0.025 |" in bench.render_table(rows, args)


def test_the_full_side_takes_the_references_population_sigma_and_alpha(tmp_path):
    bench = load_benchmark("countdown_es")
    args = bench.parse_args(["--ref_dir", "ref"])
    argv = bench.grpo_argv(args, "full", 3, tmp_path / "train.jsonl", tmp_path / "run")
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert {k: flags[k] for k in ("--zo_queries", "--zo_eps", "--learning_rate", "--method", "--zo_es_sampling",
                                  "--temperature", "--seed")} == \
        {"--zo_queries": "30", "--zo_eps": "0.001", "--learning_rate": "0.0005", "--method": "ft",
         "--zo_es_sampling": "independent", "--temperature": "0", "--seed": "3"}


def test_the_reward_grades_prompt_and_completion_with_the_prompts_numbers(reference, monkeypatch):
    reward = load_benchmark("countdown_reward")
    reward.reference_grader.cache_clear()
    prompt = "Using [3 4] make 7. Answer in <answer> </answer>."
    assert reward.numbers_of(prompt) == [3, 4]
    # the prompt's own tags give the format reward; the completion's answer the rest
    assert reward.reward([prompt, prompt], [" <answer>7</answer>", " no"], [7, 7]) == pytest.approx([1.1, 0.1])
