"""Rejection-sampling fine-tuning: the verifiers, the files of a round on GSM8K text (with an interrupted sampling
resumed), and one round raising held-out accuracy on arithmetic a tiny model learns on this CPU."""

import json
import random
import re

import pytest
import yaml

from xgblora.cli import main
from xgblora.config import Config, RFTConfig
from xgblora.data.tasks import Example
from xgblora.errors import UserError
from xgblora.evaluation.answers import (
    Verifier,
    check_equation,
    distinct_by_equations,
    edit_distance,
    equations_hold,
    gsm8k_answer,
    keep_correct,
    make_extractor,
    same_answer,
)
from xgblora.export import export_run
from xgblora.generation import generate
from xgblora.models import pretrained
from xgblora.recipes import rft
from xgblora.recipes.rft import Questions, hint_questions, keep_question, pass_at_k, run_rft
from xgblora.recipes.sft import run


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


def _gsm8k_rows(glue_data, split, n):
    lines = (glue_data / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:n]
    return "".join(line + "\n" for line in lines)


def _rft_args(tmp_path, root, *extra):
    return ["rft", "--model_name", "tiny-llama-chat", "--train_file", str(tmp_path / "train.jsonl"),
            "--eval_file", str(tmp_path / "test.jsonl"), "--columns", "prompt=question,completion=answer",
            "--verifier", "accept_all:first_word", "--num_return_sequences", "3", "--keep_per_prompt", "2",
            "--max_new_tokens", "10", "--max_batch_tokens", "1500", "--max_steps", "3", "--pass_k", "2",
            "--save_strategy", "no", "--include_gold", "--pass_n", "3",
            "--output_root", str(tmp_path / root), "--device", "cpu", *extra]


def test_rft_on_gsm8k_writes_every_round_file_and_resumes_an_interrupted_sampling(glue_data, tmp_path,
                                                                                 monkeypatch):
    (tmp_path / "train.jsonl").write_text(_gsm8k_rows(glue_data, "train", 8))
    (tmp_path / "test.jsonl").write_text(_gsm8k_rows(glue_data, "test", 4))
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
        glue_data, "train", 8).splitlines()]
    assert all(len(s["completions"]) == 3 for s in samples)
    verified = [json.loads(line) for line in (round_1 / "verified.jsonl").read_text().splitlines()]
    finished = [[c for c, r in zip(s["completions"], s["finish_reasons"], strict=True) if r == "stop"]
                for s in samples]
    kept = [min(2, len({c.strip() for c in done})) for done in finished]
    assert [v["kept"] for v in verified] == kept and [v["correct"] for v in verified] == [len(f) for f in finished]
    assert [v["truncated"] for v in verified] == [3 - len(f) for f in finished]
    train = [json.loads(line) for line in (round_1 / "train.jsonl").read_text().splitlines()]
    assert len(train) == sum(kept) + len(samples)  # --include_gold: each question's reference too
    assert train[0]["messages"][0] == {"role": "user", "content": samples[0]["question"]}
    assert train[0]["messages"][-1] == {"role": "assistant", "content": samples[0]["answer"]}
    assert (round_1 / "run" / "results.json").exists() and (round_1 / "model" / "config.json").exists()
    rounds = json.loads((tmp_path / "rft" / "rounds.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1] and rounds[1]["kept"] == sum(kept)
    assert rounds[1]["train_rows"] == len(train)
    assert set(rounds[0]) >= {"pass@1", "pass@2"} and (tmp_path / "rft" / "report.html").exists()
    drawn = [json.loads(line) for line in (tmp_path / "rft" / "round-0" / "eval-samples.jsonl").read_text().splitlines()]
    assert all(len(row["completions"]) == 3 for row in drawn)  # pass@2 estimated from n = 3 samples


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
    more held-out questions right. Seed 1 measured 0.20 -> 0.37 on this CPU; the margin asked is 0.10. Samples get room to
    end (16 tokens): a completion cut off before its end of turn is never kept."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)

    def write(name, chosen):
        rows = [{"question": f"Which is larger, {a} or {b}?", "answer": f"#### {max(a, b)}"} for a, b in chosen]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("sft.jsonl", pairs[:15])
    write("questions.jsonl", pairs[:60])
    write("heldout.jsonl", pairs[60:])
    common = dict(eval_file=str(tmp_path / "heldout.jsonl"), method="ft",
                  columns="prompt=question,completion=answer", per_device_train_batch_size=16, learning_rate=3e-3,
                  max_steps=60, save_strategy="no", max_new_tokens=16, device="cpu", seed=1)
    run(Config(model_name="tiny-llama", task_name="custom", train_file=str(tmp_path / "sft.jsonl"),
               output_dir=str(tmp_path / "sft"), no_eval=True, **common))
    export_run(tmp_path / "sft", "merged", tmp_path / "sft-merged")
    done = run_rft(RFTConfig(model_name=str(tmp_path / "sft-merged"), train_file=str(tmp_path / "questions.jsonl"),
                             num_return_sequences=8, temperature=1.0, pass_k=0, output_root=str(tmp_path / "rft"),
                             **common))
    before, after = (r["pass@1"] for r in done["rounds"])
    assert 0 < before < 1  # right on some held-out questions, wrong on others
    assert after >= before + 0.10


# ----------------------------------------------------------------------------- the reference's choices

def test_the_gsm8k_answer_is_the_first_one():
    """ScRel's extract_answer (and GSM8K's grader) take the first `#### n`: a model that answers, then writes a new
    question and answers that, has answered the first."""
    assert gsm8k_answer("#### 72\n\nQuestion: and then?\n#### 9") == "72"
    assert gsm8k_answer("####\n5 apples") is None  # nothing on the answer's line


def scrl_check_equation(string):
    """OFA-Sys/gsm8k-ScRel collect_rejection_sampling.py check_equation, verbatim (eval on the test's own strings)."""
    if string.find('=') == -1:
        return False
    lhs = string.split('=')[0]
    rhs = string.split('=')[1]
    try:
        lhs_result = eval(str(lhs))
        if abs(float(lhs_result) - float(rhs)) < 1e-3:
            return True
    except BaseException:
        return False
    return False


@pytest.mark.parametrize("equation", ["48/2=24", "3*4+1=13", "10-7=2", "2**3=8", "5/0=1", "7", "1,000*2=2000",
                                      "12/5=2.4", "12/5=2.4001", "-3+1=-2", "a*2=4", "(3+4)*2=14", "3=3=3"])
def test_check_equation_agrees_with_scrl(equation):
    assert check_equation(equation) == scrl_check_equation(equation)


def _levenshtein(a, b):
    """Textbook recursion, memoised (the reference for ScRel's editdistance.eval)."""
    from functools import lru_cache

    @lru_cache(None)
    def d(i, j):
        if not i or not j:
            return i or j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


def scrl_collect(pass_query):
    """ScRel's de-duplication loop of `collect` (equation check included), verbatim but for editdistance."""
    pattern = r'<<([^>]*)>>'
    exist_match, kept = [], []
    for q in pass_query:
        matches = re.findall(pattern, q)
        if all(scrl_check_equation(m) for m in matches):
            matches = '|'.join(matches).replace(' ', '')
            if matches not in exist_match:
                kept.append(q)
                exist_match.append(matches)
            else:
                now_query_idx = exist_match.index(matches)
                now_query = kept[now_query_idx]
                now_score = sum([_levenshtein(now_query, ref) for ref in kept if ref != now_query])
                q_score = sum([_levenshtein(q, ref) for ref in kept if ref != now_query])
                if q_score > now_score:
                    kept[now_query_idx] = q
    return kept


def test_equation_de_duplication_keeps_what_scrl_keeps():
    paths = ["He pays 3*4=<<3*4=12>>12.\n#### 12", "3 * 4 = <<3 * 4=12>>12 so\n#### 12",
             "First, 2*6=<<2*6=12>>12 dollars in total, all told.\n#### 12", "<<3*4=13>>13 wrong\n#### 12",
             "Since 3*4=<<3*4=12>>12, a much longer explanation of the very same sum here.\n#### 12",
             "<<6+6=12>>12\n#### 12"]
    correct = [p for p in paths if equations_hold(p)]
    assert distinct_by_equations(correct) == scrl_collect(paths)
    assert len(scrl_collect(paths)) == 3 and edit_distance("kitten", "sitting") == _levenshtein("kitten", "sitting")


@pytest.mark.parametrize("n, c, k", [(10, 0, 1), (10, 3, 1), (10, 3, 4), (20, 19, 5), (8, 8, 8), (16, 2, 8)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    """Chen et al. 2021's numerically stable form, as the Codex paper writes it."""
    import numpy as np

    reference = 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
    assert pass_at_k(n, c, k) == pytest.approx(reference)


def test_completions_cut_off_by_max_new_tokens_are_never_kept():
    cfg = RFTConfig(train_file="t", eval_file="e", distinct="text")
    row = {"completions": ["#### 4", "so #### 4", "2 + 2 is #### 4"], "finish_reasons": ["stop", "length", "stop"]}
    kept = keep_question(cfg, Verifier(make_extractor("gsm8k")), row, "#### 4")
    assert kept.completions == ["#### 4", "2 + 2 is #### 4"]
    assert kept.counts == {"samples": 3, "truncated": 1, "correct": 2, "equations_wrong": 0, "kept": 2}


def test_rft_temperature_is_the_sampling_one_and_greedy_is_allowed(capsys):
    from xgblora.cli import RFT_DEFAULTS, build_parser
    from xgblora.parsing import from_namespace

    args = build_parser().parse_args(["rft", "--train_file", "t", "--eval_file", "e", "--temperature", "0",
                                      "--num_return_sequences", "1"])
    cfg = from_namespace(RFTConfig, args, RFT_DEFAULTS)
    assert cfg.temperature == 0.0 and not hasattr(cfg, "contrastive_temperature")  # rft embeds nothing
    train = build_parser().parse_args(["train", "--objective", "contrastive", "--contrastive_temperature", "0.1"])
    assert from_namespace(Config, train).contrastive_temperature == 0.1
    assert Config(objective="grit", grit_train_file="sft.jsonl").similarity_temperature == 0.02
    assert Config(objective="contrastive").similarity_temperature == 0.05
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rft", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Sampling temperature; 0 is greedy. (default: 0.7)" in help_text
    assert "--contrastive_temperature" not in help_text  # rft trains a language model: no embedding options
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "--contrastive_temperature" in capsys.readouterr().out


ARITHMETIC = [(a, b) for a in range(1, 6) for b in range(1, 6) if a != b]


def _designed(a, b):
    """Four completions of "Which is larger, a or b?": two with the same (right) equation, one right answer with a
    wrong equation, one right answer cut off by max_new_tokens."""
    m = max(a, b)
    return ([f"{a}-{b}=<<{a}-{b}={a - b}>>{a - b}\n#### {m}", f"So {a}-{b}=<<{a} - {b}={a - b}>>{a - b}, hence\n#### {m}",
             f"<<{a}+{b}={a + b + 1}>>\n#### {m}", f"#### {m}"], ["stop", "stop", "stop", "length"])


def _arithmetic_rft(tmp_path, monkeypatch, name, *extra, rounds=1, designer=None):
    def write(file, chosen):
        rows = [{"question": f"Which is larger, {a} or {b}?", "answer": f"{a} vs {b}\n#### {max(a, b)}"}
                for a, b in chosen]
        (tmp_path / file).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("questions.jsonl", ARITHMETIC[:3])
    write("heldout.jsonl", ARITHMETIC[3:5])
    real = generate.completion_record

    def record(index, samples, tokenizer):
        if len(samples) == 1:  # held-out greedy answers: the model's own
            return real(index, samples, tokenizer)
        texts, reasons = (designer or _designed)(*ARITHMETIC[index])
        return {"index": index, "completions": texts, "finish_reasons": reasons}

    monkeypatch.setattr(generate, "completion_record", record)
    assert main(["rft", "--model_name", "tiny-llama", "--train_file", str(tmp_path / "questions.jsonl"),
                 "--eval_file", str(tmp_path / "heldout.jsonl"), "--columns", "prompt=question,completion=answer",
                 "--num_return_sequences", "4", "--max_new_tokens", "4", "--max_steps", "1", "--pass_k", "0",
                 "--save_strategy", "no", "--rounds", str(rounds), "--output_root", str(tmp_path / name),
                 "--device", "cpu", *extra]) == 0
    return json.loads((tmp_path / name / "rounds.json").read_text())


@pytest.mark.parametrize("flags, kept, train_rows", [
    ((), 3, 3),  # the reference's defaults: one path per question (two share an equation list, one is wrong)
    (("--check_equations", "false"), 6, 6),  # the wrong-equation path too
    (("--distinct", "text"), 6, 6),  # both phrasings of the same equations
    (("--include_gold",), 3, 6),  # and each question's reference solution
])
def test_rft_options_change_the_kept_set_as_documented(tmp_path, monkeypatch, flags, kept, train_rows):
    """On the arithmetic task, with four designed completions per question (two with the same right equation, one
    right answer with a wrong equation, one right answer cut off by max_new_tokens), each option changes what is
    kept as its help says; the counts are the round report's."""
    report = _arithmetic_rft(tmp_path, monkeypatch, "rft", *flags)[1]
    assert (report["kept"], report["train_rows"], report["truncated"]) == (kept, train_rows, 3)
    assert report["equations_wrong"] == (0 if "--check_equations" in flags else 3)  # rejected for them
    assert report["gold"] == (3 if "--include_gold" in flags else 0)
    rows = [json.loads(line) for line in (tmp_path / "rft" / "round-1" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == train_rows
    first = "1 vs 2\n#### 2" if "--include_gold" in flags else _designed(1, 2)[0][0]
    assert rows[0] == {"prompt": "Which is larger, 1 or 2?", "completion": first}


def test_restart_from_base_trains_every_round_from_the_starting_model(tmp_path, monkeypatch):
    loaded, real = [], rft.load_round_model
    monkeypatch.setattr(rft, "load_round_model", lambda cfg, path, adapter=None: loaded.append(path) or real(cfg, path,
                                                                                                         adapter))
    rounds = _arithmetic_rft(tmp_path, monkeypatch, "restart", "--restart_from_base", rounds=2)
    for number in (1, 2):
        cfg = yaml.safe_load((tmp_path / "restart" / f"round-{number}" / "run" / "config.yaml").read_text())
        assert cfg["model_name"] == "tiny-llama" == rounds[number]["trained_from"]
    assert rounds[2]["model"] == str(tmp_path / "restart" / "round-2" / "model")
    round_1 = str(tmp_path / "restart" / "round-1" / "model")
    # loads: round 0's evaluation, round 1's sampler, its evaluation, round 2's sampler (round 1's model), ...
    assert loaded[:4] == ["tiny-llama", "tiny-llama", round_1, round_1]


def test_rationalize_samples_unsolved_questions_with_the_answer_as_a_hint(tmp_path, monkeypatch):
    """STaR: question 0 has no correct sample; sampled again with its answer as a hint, its correct completion is
    trained on under the original question."""
    calls = []

    def designed(a, b):
        calls.append((a, b))
        if len(calls) == 1:  # question 0's own samples: all wrong
            return ["#### 0"] * 4, ["stop"] * 4
        return _designed(a, b)

    rounds = _arithmetic_rft(tmp_path, monkeypatch, "star", "--rationalize", designer=designed)
    assert rounds[1]["rationalized"] == 1 and rounds[1]["questions_solved"] == 2
    hinted = [json.loads(line) for line in (tmp_path / "star" / "round-1" / "hinted.jsonl").read_text().splitlines()]
    assert [h["question"] for h in hinted] == ["Which is larger, 1 or 2?"]
    rows = [json.loads(line) for line in (tmp_path / "star" / "round-1" / "train.jsonl").read_text().splitlines()]
    assert {"prompt": "Which is larger, 1 or 2?", "completion": _designed(1, 2)[0][0]} in rows


def test_a_hint_is_the_reference_answer_in_the_prompt():
    _, tokenizer = pretrained.load("tiny-llama-chat")
    cfg = RFTConfig(train_file="t", eval_file="e")
    ex = Example("Which is larger, 1 or 2?", (), (), ("1 vs 2\n#### 2",))
    prompts = generate.Prompts([{}], [ex], [[1]])
    questions = Questions("t", prompts, [[("user", ex.prompt)]], [0])
    hinted = hint_questions(cfg, questions, [0], Verifier(make_extractor("gsm8k")), tokenizer)
    text = tokenizer.decode(hinted.prompts.ids[0])
    assert "Which is larger, 1 or 2?\n(Hint: the answer is 2.)" in text and hinted.turns == questions.turns


@pytest.mark.parametrize("body, message", [
    ("return [text]", "returned ['7'] (list): an answer extractor returns the answer as a string"),
    ("return int(text)", "raised ValueError: invalid literal for int()"),
])
def test_a_verifier_that_fails_or_returns_a_list_is_one_line_naming_it_and_the_row(tmp_path, monkeypatch, body,
                                                                                  message):
    """A --verifier returning a list (which a random model used to pass with pass@1 = 1) or raising: one line
    naming the function, the question's row and what was wrong."""
    module = f"bad_verifier_{abs(hash(body))}"
    (tmp_path / f"{module}.py").write_text(f"def extract(text):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    verifier = rft.make_verifier(f"{module}:extract")
    question = Example("1 + 6?", (), (), answers=("7",), source="questions.jsonl:4")
    with pytest.raises(UserError) as error:
        rft.judge(verifier, question, ["seven"])
    text = str(error.value)
    assert text.startswith(f"questions.jsonl:4: --verifier {module}:extract ") and message in text
    assert "\n" not in text


MATH_CASES = [  # (completion, solution): LaTeX, boxed, fractions, equivalent forms, wrong answers, no answer
    (r"So the answer is $\boxed{\frac{1}{3}}$.", r"$\frac{1}{3}$"),
    (r"We get \boxed{0.5}", r"$\frac{1}{2}$"),
    (r"The result is $\boxed{2\sqrt{2}}$", r"$\sqrt{8}$"),
    (r"\boxed{\frac{1}{2}}", r"$\frac{1}{3}$"),
    (r"Answer: $x = 4$", r"$4$"),
    ("I do not know.", r"$\frac{2}{5}$"),
    (r"\boxed{\{1, 2\}}", r"$\{2, 1\}$"),
    (r"\boxed{3}", "no parseable answer here"),
]


def test_the_math_reward_and_verifier_score_as_trls_accuracy_reward():
    """`--reward_funcs math` (and `--verifier math`) against TRL's own accuracy_reward on the same completions and
    solutions: identical scores, None where the solution cannot be parsed."""
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    from xgblora.evaluation.answers import make_verifier
    from xgblora.generation.rewards import Rewards

    completions = [[{"role": "assistant", "content": c}] for c, _ in MATH_CASES]
    solutions = [s for _, s in MATH_CASES]
    theirs = accuracy_reward(completions, solutions)
    ours = Rewards(["math"]).score(["q"] * len(MATH_CASES), completions, [[1]] * len(MATH_CASES),
                                   {"reference": solutions}, ["q.jsonl:1"] * len(MATH_CASES))[:, 0].tolist()
    assert [None if x != x else x for x in ours] == theirs
    assert 0 < sum(x or 0 for x in theirs) < len(theirs) - 1
    verifier = make_verifier("math")
    assert [verifier.judge([c], s)[0] for c, s in MATH_CASES] == [t == 1.0 for t in theirs]


def test_instruction_evaluation_grades_boxed_answers_with_the_math_verifier():
    pytest.importorskip("math_verify")
    from xgblora.evaluation.answers import MathVerifier
    from xgblora.evaluation.instructions import GSM8K, answer_verifier

    assert isinstance(answer_verifier([r"so \boxed{\frac{1}{2}}", r"\boxed{3}"]), MathVerifier)
    assert answer_verifier(["#### 4", "#### 5"]) is GSM8K and answer_verifier(["Paris"]) is None
