"""`xgblora reward` end to end on tiny-llama: training raises the held-out preference accuracy, every method and
both trainers save a model that scores as it did in the run, the saved model loads in plain transformers and scores
`xgblora grpo --reward_model` rollouts as TRL's GRPOTrainer scores them; bad input stops in one line."""

import json
from pathlib import Path

import pytest
import torch
from helpers import addition_pairs, preference_run
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from xgblora import cli
from xgblora.adapters import trained
from xgblora.data.preference import read_preferences, reward_seqs
from xgblora.generation.rewards import load_reward_model
from xgblora.preference.reward import evaluate_rewards


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Additions: the right sum is chosen over a wrong one."""
    return addition_pairs(tmp_path_factory.mktemp("reward") / "pairs.jsonl")


def reward(out, pairs, *flags):
    return preference_run("reward", out, pairs, *flags)


def trl_scores(model, tokenizer, prompts, completions):
    """TRL's GRPOTrainer._calculate_rewards for a model among the reward functions (grpo_trainer.py, the
    `isinstance(reward_func, nn.Module)` branch): standard prompts joined to their completions, tokenised without
    special tokens, right-padded; the first logit."""
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return model(**inputs).logits[:, 0]


@pytest.mark.slow
def test_training_raises_the_preference_accuracy(tmp_path, pairs, capsys):
    """LoRA under AdamW learns the pairs; TRL's metrics are logged, the progress line shows accuracy and margin."""
    capsys.readouterr()
    results, logged = reward(tmp_path / "rm", pairs, "--max_steps", "16", "--learning_rate", "1e-2")
    assert logged[-1]["loss"] < logged[0]["loss"] and results["eval_accuracy"] >= 0.75
    assert results["eval_loss"] < 0.6 and results["eval_margin"] > 0
    for name in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert name in logged[-1]
    line = next(line for line in capsys.readouterr().err.splitlines() if "step 16/16" in line)
    assert "acc " in line and "margin " in line


def test_the_model_loads_in_transformers_and_scores_grpo_rollouts_as_trl(tmp_path, pairs):
    """The run exported as a merged model loads in transformers' AutoModelForSequenceClassification and scores as
    the run's folder does through --reward_model, which scores GRPO's sampled completions as TRL does."""
    reward(tmp_path / "rm", pairs, "--max_steps", "2", "--learning_rate", "1e-2")
    assert cli.main(["export", str(tmp_path / "rm"), "--format", "merged", "--output_dir", str(tmp_path / "merged")]) == 0
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    served = load_reward_model(str(tmp_path / "rm"), dtype="float32", device="cpu")
    rows = [json.loads(line) for line in Path(pairs).read_text().splitlines()]
    prompts, completions = [r["prompt"] for r in rows], [r["chosen"] for r in rows]
    want = trl_scores(model, tokenizer, prompts, completions)
    assert torch.allclose(torch.tensor(served(prompts, completions)), want, atol=1e-5)
    assert served.name == "rm" and want.std() > 0

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[:2]))
    code = cli.main(["grpo", "--model_name", "tiny-llama", "--train_file", str(prompts_file), "--reward_model",
                     str(tmp_path / "rm"), "--num_generations", "2", "--per_device_train_batch_size", "4",
                     "--max_new_tokens", "4", "--max_steps", "1", "--logging_steps", "1", "--log_completions",
                     "--output_dir", str(tmp_path / "grpo")])
    assert code == 0
    record = next(json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
                  if "samples" in line)
    samples = record["samples"]
    theirs = trl_scores(model, tokenizer, [s["prompt"]["prompt"] for s in samples], [s["completion"] for s in samples])
    assert torch.allclose(torch.tensor([s["reward"] for s in samples]), theirs, atol=1e-5)
    assert "rewards/rm" in record and "accuracy" not in record


@pytest.mark.parametrize("flags", [("--method", "ft"), ("--method", "xgblora"),
                                   ("--method", "lora", "--trainer", "zo", "--center_rewards_coefficient", "0.01")])
def test_every_method_and_trainer_saves_the_model_it_scored(tmp_path, pairs, flags):
    """After a few steps the held-out loss of the model loaded back from final/ (a whole classifier for full
    fine-tuning, else the adapter and its score head) is the run's own eval_loss, and it moved from the start."""
    results, logged = reward(tmp_path / "run", pairs, *flags, "--max_steps", "3", "--learning_rate", "1e-3",
                             "--eval_on_start")
    assert len(logged) == 3 and results["eval_loss"] != results["before_eval_loss"]
    model, tokenizer = trained.load_model(trained.resolve(str(tmp_path / "run")), head="classifier")
    seqs = reward_seqs(tokenizer, read_preferences(pairs), None)
    center = 0.01 if "--center_rewards_coefficient" in flags else None
    again = evaluate_rewards(model, seqs, tokenizer.pad_token_id, 8, torch.device("cpu"), center)
    assert again["loss"] == pytest.approx(results["eval_loss"], abs=1e-5)
    if flags[1] == "ft":  # the whole classifier: transformers loads final/ as it is
        plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "final")
        assert evaluate_rewards(plain, seqs, tokenizer.pad_token_id, 8, torch.device("cpu"))["loss"] == \
            pytest.approx(results["eval_loss"], abs=1e-5)


def test_a_row_without_rejected_stops_before_the_model_loads(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "q", "chosen": " a"}) + "\n")
    code = cli.main(["reward", "--model_name", "no-such-model-anywhere", "--train_file", str(path),
                     "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f'{path}:1: field "rejected": missing' in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("model", "message"), [("missing-folder/", "no such folder"),
                                                ("tiny-llama", "not a sequence classifier")])
def test_a_bad_reward_model_stops_before_the_policy_loads(tmp_path, capsys, monkeypatch, model, message):
    from xgblora.recipes import grpo

    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: pytest.fail("the policy loaded"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    code = cli.main(["grpo", "--train_file", str(prompts), "--reward_model", str(tmp_path / model) if "/" in model
                     else model, "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--reward_model" in err[0] and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--center_rewards_coefficient", "-1"], "--center_rewards_coefficient"),
    (["--trainer", "zo", "--disable_dropout", "false"], "--disable_dropout"),
    (["--beta", "0.1"], "--beta")])
def test_bad_options(tmp_path, capsys, flags, message):
    code = cli.main(["reward", "--train_file", "x.jsonl", "--output_dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()
