"""`xgblora dpo` end to end on tiny-llama: the reference is the starting model for every method (the first loss is
DPO's log 2), training raises the held-out reward accuracy, TRL's metrics reach metrics.jsonl, options are checked."""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import addition_pairs, preference_run

from xgblora import cli
from xgblora.config import DPOConfig


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return addition_pairs(tmp_path_factory.mktemp("dpo") / "pairs.jsonl")


def dpo(tmp_path, pairs, *flags):
    return preference_run("dpo", tmp_path / "run", pairs, *flags)


@pytest.mark.parametrize("flags", [("--method", "lora"), ("--method", "xgblora"), ("--method", "ft"),
                                   ("--method", "lora", "--precompute_ref_log_probs")])
def test_first_step_is_at_the_reference(tmp_path, pairs, flags):
    """Before the first update the policy is the reference: every log ratio is 0, so the loss is log 2 and the
    rewards 0, whichever way the reference is had (adapters off, or precomputed)."""
    _, logged = dpo(tmp_path, pairs, *flags, "--max_steps", "1")
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert logged[0]["rewards/chosen"] == pytest.approx(0, abs=1e-5)
    assert logged[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)


@pytest.mark.parametrize("method", ["lora", "ft"])
def test_dropout_is_off_in_training_forwards_by_default(tmp_path, pairs, method):
    """tiny-opt has dropout 0.1: with it on, the policy's forward differs from the reference's at the reference
    point. TRL's disable_dropout (on by default) takes it out, so the first loss is log 2; false keeps it."""
    flags = ("--model_name", "tiny-opt", "--method", method, "--beta", "1", "--max_steps", "1")
    _, logged = dpo(tmp_path / "off", pairs, *flags)
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    _, logged = dpo(tmp_path / "on", pairs, *flags, "--disable_dropout", "false")
    assert abs(logged[0]["loss"] - math.log(2)) > 1e-3


def test_continued_adapter_is_its_own_reference(tmp_path, pairs):
    first, _ = dpo(tmp_path / "a", pairs, "--max_steps", "8", "--learning_rate", "1e-2")
    assert first["eval_rewards/margins"] > 0
    _, logged = dpo(tmp_path / "b", pairs, "--adapter", str(tmp_path / "a" / "run"), "--max_steps", "1")
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)


@pytest.mark.slow  # trains to an accuracy
def test_training_raises_the_reward_accuracy(tmp_path, pairs, capsys):
    """The loss falls and held-out reward accuracy reaches 1; TRL's metrics are logged, the progress line shows the
    preference accuracy and margin, report.html draws them."""
    capsys.readouterr()
    results, logged = dpo(tmp_path, pairs, "--max_steps", "12", "--learning_rate", "1e-2", "--beta", "0.5")
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.1
    assert results["eval_rewards/accuracies"] == 1.0 and results["eval_loss"] < math.log(2) - 0.1
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "logits/chosen", "logits/rejected"):
        assert name in logged[-1]
    line = next(line for line in capsys.readouterr().err.splitlines() if "step 12/12" in line)
    assert f"pref_acc {logged[-1]['rewards/accuracies']:.4g}" in line and "margin" in line
    page = (tmp_path / "run" / "report.html").read_text()
    assert (tmp_path / "run" / "dpo.png").is_file() and "preference accuracy" not in page  # the figure is an image
    assert "eval_rewards/accuracies" in page


def test_zeroth_order_runs_the_same_loss(tmp_path, pairs):
    results, logged = dpo(tmp_path, pairs, "--trainer", "zo", "--max_steps", "2", "--learning_rate", "1e-4")
    assert all(math.isfinite(m["loss"]) for m in logged) and abs(logged[0]["loss"] - math.log(2)) < 0.05
    assert results["steps"] == 2


def test_verifier_scores_the_greedy_completions_generate_gives(tmp_path, pairs, monkeypatch):
    """--verifier: held-out pass@1 before training (--eval_on_start) is the share of prompts whose greedy completion,
    as transformers' generate decodes it, the verifier accepts: references equal to it on half the rows."""
    from xgblora.data.preference import encode, read_preferences
    from xgblora.models import pretrained

    model, tokenizer = pretrained.load("tiny-llama")
    examples, rows = read_preferences(pairs), [json.loads(line) for line in Path(pairs).read_text().splitlines()]
    for i, (ex, row) in enumerate(zip(examples, rows, strict=True)):
        ids = torch.tensor([encode(tokenizer, ex).prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        row["reference"] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) if i % 2 else "none of it"
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "whole.py").write_text("def answer(text):\n    return text.strip()\n")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["dpo", "--model_name", "tiny-llama", "--train_file", pairs, "--eval_file", str(held_out),
                     "--verifier", "whole:answer", "--max_new_tokens", "4",
                     "--eval_on_start", "--max_steps", "1", "--output_dir", "run"])
    assert code == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["before_eval_pass@1"] == 0.5 and 0 <= results["eval_pass@1"] <= 1


def test_verifier_needs_a_reference_in_every_held_out_row(tmp_path, pairs, capsys):
    assert cli.main(["dpo", "--train_file", pairs, "--eval_file", pairs, "--verifier", "gsm8k",
                     "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "field \"reference\": missing" in err and "pairs.jsonl" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--loss_type", "kto"], "--loss_type kto"), (["--loss_weights", "1", "2"], "--loss_weights"),
    (["--beta", "0"], "--beta"), (["--label_smoothing", "0.5"], "--label_smoothing"),
    (["--loss_type", "sft", "--rpo_alpha", "1"], "--rpo_alpha"), (["--packing"], "--packing"),
    (["--trainer", "zo", "--disable_dropout", "false"], "--disable_dropout")])
def test_bad_options(tmp_path, capsys, flags, message):
    code = cli.main(["dpo", "--train_file", "x.jsonl", "--output_dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_rpo_alpha_is_the_sft_term():
    cfg = DPOConfig(train_file="x.jsonl", rpo_alpha=0.3)
    assert cfg.loss_terms == (("sigmoid", "sft"), (1.0, 0.3))


def test_resume_continues_exactly(tmp_path, pairs):
    """A checkpoint at step 2 (of a three-step run), resumed to step 4: the adapter of an uninterrupted four-step run
    (the reference log-probabilities are the starting model's both times, computed before the checkpoint loads)."""
    from safetensors.torch import load_file

    common = ["--precompute_ref_log_probs", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
              "--save_strategy", "steps", "--save_steps", "2"]
    dpo(tmp_path / "whole", pairs, *common, "--max_steps", "4")
    dpo(tmp_path / "parts", pairs, *common, "--max_steps", "3")
    resumed, logged = dpo(tmp_path / "parts", pairs, *common, "--max_steps", "4", "--resume_from_checkpoint", "latest",
                          "--overwrite_output_dir")
    assert resumed["resumes"] == 1 and [m["step"] for m in logged][-2:] == [3, 4]
    whole = load_file(tmp_path / "whole" / "run" / "final" / "adapter_model.safetensors")
    parts = load_file(tmp_path / "parts" / "run" / "final" / "adapter_model.safetensors")
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
