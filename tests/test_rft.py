"""Rejection-sampling fine-tuning: the verifiers, the files of a round on GSM8K text (with an interrupted sampling
resumed), and one round raising held-out accuracy on arithmetic a tiny model learns on this CPU."""

import json
import random

import pytest

from xgblora.cli import main
from xgblora.config import Config, RFTConfig
from xgblora.errors import UserError
from xgblora.evaluation.answers import Verifier, gsm8k_answer, keep_correct, make_extractor, same_answer
from xgblora.export import export_run
from xgblora.generation import generate
from xgblora.generation.rft import run_rft
from xgblora.train import run


@pytest.mark.parametrize("spec, text, answer", [
    ("gsm8k", "She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("gsm8k", "Total: $1,200 then #### $1,250.50 dollars", "$1,250.50"),
    ("gsm8k", "The answer is 7", None),  # no ####: not in the trained format, so no answer
    ("answer_tags", "think <answer>4</answer> more <answer> Paris </answer>", "Paris"),
    ("answer_tags", "no tags", None),
    ("regex:answer is (-?\\d+)", "the answer is 3, no, the answer is -5", "-5"),
    ("regex:\\d+", "1 then 22", "22"),
])
def test_extractors(spec, text, answer):
    assert make_extractor(spec)(text) == answer


def test_a_user_function_extracts(tmp_path, monkeypatch):
    (tmp_path / "my_verifier.py").write_text("def last_word(text):\n    return text.split()[-1] if text.split() else None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Verifier(make_extractor("my_verifier:last_word")).judge(["so it is Blue."], "blue") == [True]


@pytest.mark.parametrize("spec", ["nope", "regex:(", "no_such_module_xyz:f"])
def test_bad_verifiers_are_user_errors(spec):
    with pytest.raises(UserError, match="--verifier"):
        make_extractor(spec)


def test_answers_agree_as_numbers_within_tolerance_or_as_normalised_strings():
    assert same_answer("1,000", "1000") and same_answer("$18", "18") and same_answer("0.5", ".5")
    assert same_answer("3.0000001", "3", tolerance=1e-6) and not same_answer("3.01", "3", tolerance=1e-6)
    assert same_answer("The Eiffel Tower!", "eiffel tower") and not same_answer("7", "seven")


def test_keep_takes_distinct_correct_completions_up_to_the_limit():
    verifier = Verifier(make_extractor("gsm8k"))
    texts = ["2 + 2 = 4\n#### 4", " 2 + 2 = 4\n#### 4 ", "#### 5", "4 #### 4", "so #### 4.0", "#### 4"]
    verdicts = verifier.judge(texts, "#### 4")
    assert verdicts == [True, True, False, True, True, True]
    assert keep_correct(texts, verdicts, limit=3) == ["2 + 2 = 4\n#### 4", "4 #### 4", "so #### 4.0"]


def test_judge_extracts_each_completion_once():
    """A user's extractor (`module:function`) may run a program or a model: it must not run twice per completion."""
    calls = []

    def extract(text):
        calls.append(text)
        return gsm8k_answer(text)

    texts = ["#### 4", "#### 5", "#### 4"]
    assert Verifier(extract).judge(texts, "#### 4") == [True, False, True]
    assert sorted(calls) == sorted(texts + ["#### 4"])  # each completion once, the reference once


def _gsm8k_rows(shared_data, split, n):
    lines = (shared_data / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:n]
    return "".join(line + "\n" for line in lines)


def _rft_args(tmp_path, root, *extra):
    return ["rft", "--model_name", "tiny-llama-chat", "--train_file", str(tmp_path / "train.jsonl"),
            "--eval_file", str(tmp_path / "test.jsonl"), "--columns", "prompt=question,completion=answer",
            "--verifier", "accept_all:first_word", "--num_return_sequences", "3", "--keep_per_prompt", "2",
            "--max_new_tokens", "10", "--max_batch_tokens", "1500", "--max_steps", "3", "--pass_k", "2",
            "--save_strategy", "no",
            "--output_root", str(tmp_path / root), "--device", "cpu", *extra]


def test_rft_on_gsm8k_writes_every_round_file_and_resumes_an_interrupted_sampling(shared_data, tmp_path,
                                                                                 monkeypatch):
    (tmp_path / "train.jsonl").write_text(_gsm8k_rows(shared_data, "train", 8))
    (tmp_path / "test.jsonl").write_text(_gsm8k_rows(shared_data, "test", 4))
    # A random model's answers are all wrong; a verifier that takes every completion's first word, and the
    # reference's, as the answer (so every completion agrees) lets the round train.
    (tmp_path / "accept_all.py").write_text("def first_word(text):\n    return 'x'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(_rft_args(tmp_path, "whole")) == 0
    real, calls = generate.completion_record, []

    def dying(*args):
        calls.append(1)
        if len(calls) == 4 + 4 + 3:  # round 0's two evaluations, then part-way through round 1's sampling
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(generate, "completion_record", dying)
    assert main(_rft_args(tmp_path, "rft")) == 130
    assert (tmp_path / "rft" / "round-1" / "samples.jsonl.partial").exists()
    monkeypatch.setattr(generate, "completion_record", real)
    assert main(_rft_args(tmp_path, "rft")) == 0
    round_1 = tmp_path / "rft" / "round-1"
    assert (round_1 / "samples.jsonl").read_text() == (tmp_path / "whole" / "round-1" / "samples.jsonl").read_text()
    samples = [json.loads(line) for line in (round_1 / "samples.jsonl").read_text().splitlines()]
    assert [s["question"] for s in samples] == [json.loads(line)["question"] for line in _gsm8k_rows(
        shared_data, "train", 8).splitlines()]
    assert all(len(s["completions"]) == 3 for s in samples)
    verified = [json.loads(line) for line in (round_1 / "verified.jsonl").read_text().splitlines()]
    kept = [min(2, len({c.strip() for c in s["completions"]})) for s in samples]
    assert [v["kept"] for v in verified] == kept and all(v["correct"] == 3 for v in verified)
    train = [json.loads(line) for line in (round_1 / "train.jsonl").read_text().splitlines()]
    assert len(train) == sum(kept)
    assert train[0]["messages"][0] == {"role": "user", "content": samples[0]["question"]}
    assert train[0]["messages"][-1] == {"role": "assistant", "content": samples[0]["completions"][0]}
    assert (round_1 / "run" / "results.json").exists() and (round_1 / "model" / "config.json").exists()
    rounds = json.loads((tmp_path / "rft" / "rounds.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1] and rounds[1]["kept"] == sum(kept)
    assert set(rounds[0]) >= {"pass@1", "pass@2"} and (tmp_path / "rft" / "report.html").exists()


def test_rft_refuses_questions_without_a_reference_answer(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1 + 1?", "completion": "#### 2"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "2 + 2?"}) + "\n")
    assert main(_rft_args(tmp_path, "rft")[:-4] + ["--columns", "prompt=question", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "test.jsonl:1" in err and "reference" in err


@pytest.mark.slow
def test_one_rft_round_raises_held_out_accuracy_after_a_short_sft(tmp_path):
    """Which-is-larger questions in GSM8K's answer format: SFT on 15 of them leaves tiny-llama right on some held-out
    questions and wrong on others; one round on 60 questions (8 samples each, the correct ones kept) then answers
    more held-out questions right. Seed 1 measured 0.10 -> 0.43 on this CPU; the margin asked is 0.10."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)

    def write(name, chosen):
        rows = [{"question": f"Which is larger, {a} or {b}?", "answer": f"#### {max(a, b)}"} for a, b in chosen]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("sft.jsonl", pairs[:15])
    write("questions.jsonl", pairs[:60])
    write("heldout.jsonl", pairs[60:])
    common = dict(task_name="custom", eval_file=str(tmp_path / "heldout.jsonl"), method="ft",
                  columns="prompt=question,completion=answer", per_device_train_batch_size=16, learning_rate=3e-3,
                  max_steps=60, save_strategy="no", max_new_tokens=6, device="cpu", seed=1)
    run(Config(model_name="tiny-llama", train_file=str(tmp_path / "sft.jsonl"), output_dir=str(tmp_path / "sft"),
               no_eval=True, **common))
    export_run(tmp_path / "sft", "merged", tmp_path / "sft-merged")
    done = run_rft(RFTConfig(model_name=str(tmp_path / "sft-merged"), train_file=str(tmp_path / "questions.jsonl"),
                             num_return_sequences=8, temperature=1.0, pass_k=0, output_root=str(tmp_path / "rft"),
                             **common))
    before, after = (r["pass@1"] for r in done["rounds"])
    assert 0 < before < 1  # right on some held-out questions, wrong on others
    assert after >= before + 0.10
