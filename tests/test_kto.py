"""`xgblora kto` against TRL's KTOTrainer on the same tiny model and rows (its tokens, KL pairs, log-probabilities, loss
and metrics), and end to end on tiny-llama: the first step is at the reference for every method, training moves the
rewards apart, TRL's metrics reach metrics.jsonl, bad rows and options stop the run in one line."""

import copy
import json
import random
import re
from pathlib import Path

import pytest
import torch
from helpers import preference_run

from xgblora import cli
from xgblora.adapters.lora import adapters_off, attach
from xgblora.config import KTOConfig
from xgblora.data.unpaired import check_unpaired_row, collate_unpaired, encode_all, read_unpaired
from xgblora.models import pretrained
from xgblora.preference.kto import KTOLoss, KTOObjective, block, row_losses
from xgblora.preference.scoring import completion_logps, reference_logps
from xgblora.recipes.kto import weight_advice


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sums_rows(n: int, seed: int = 0) -> list[dict]:
    """Standard rows: a sum, its right answer (desirable) or a wrong one, prompts of different lengths."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 99)
        good = i % 3 != 1
        rows.append({"prompt": f"{a}+{b}=" if i % 2 else f"What is {a} plus {b}? ",
                     "completion": f" {a + b}" if good else f" {a + b + rng.randint(1, 9)} or so", "label": good})
    return rows


def long_rows(n: int) -> list[dict]:
    """Completions long beside their prompts (the KL completions then take a gradient-free pass of their own)."""
    return [{**row, "completion": row["completion"] + ", as adding the units, then the tens, then the hundreds shows"}
            for row in sums_rows(n)]


def chat_rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": row["prompt"]}],
             "completion": [{"role": "assistant", "content": row["completion"].strip()}], "label": row["label"]}
            for row in sums_rows(n)]


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """A reference that differs from the policy (the same perturbation on every copy)."""
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return ref


@pytest.mark.parametrize(("model_name", "rows", "loss_type"), [
    ("tiny-llama", sums_rows(8), "kto"), ("tiny-llama-chat", chat_rows(8), "kto"), ("tiny-llama", long_rows(8), "kto"),
    ("tiny-llama", sums_rows(8), "apo_zero_unpaired"), ("tiny-llama-chat", chat_rows(8), "apo_zero_unpaired")])
def test_tokens_logps_loss_and_metrics_equal_trl_kto_trainer(tmp_path, caplog, model_name, rows, loss_type):
    """TRL's KTOTrainer and ours on the same model, reference model and rows: the same prompt, completion and KL
    tokens; the log-probabilities of both (TRL's full rows, our shared-prompt forward); the first batch's loss (to
    1e-6) and logged metrics; the same advice on the weights for 5 desirable and 3 undesirable rows."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    policy, tokenizer = pretrained.load(model_name)
    config = trl.KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, loss_type=loss_type,
                           beta=0.3, desirable_weight=1.2, bf16=False, gradient_checkpointing=False,
                           report_to="none", use_cpu=True)
    trainer = trl.KTOTrainer(model=copy.deepcopy(policy), ref_model=perturbed(policy), args=config,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    kl = loss_type == "kto"
    examples = read_unpaired(write_rows(tmp_path / "rows.jsonl", rows))
    advice = weight_advice(KTOConfig(train_file="x", desirable_weight=1.2), examples)
    bounds = re.compile(r"\[[\d.]+, [\d.]+\]")
    assert bounds.findall(advice) == bounds.findall(caplog.text) == ["[0.6, 0.8]", "[1.5, 2.0]"]
    seqs = encode_all(tokenizer, examples, 1024, 4 if kl else None)
    for seq, theirs in zip(seqs, trainer.train_dataset, strict=True):
        assert (seq.prompt, seq.completion, seq.label) == (theirs["prompt_ids"], theirs["completion_ids"],
                                                           theirs["label"])
        assert seq.kl_completion == theirs.get("KL_completion_ids")

    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    want = trainer.compute_loss(trainer.model, inputs)
    trl_policy = trainer.compute_ref_log_probs(trainer.model, inputs)
    trl_ref = trainer.compute_ref_log_probs(trainer.ref_model, inputs)

    ours_ref = reference_logps(perturbed(policy), seqs[:4], lambda r: collate_unpaired(r, tokenizer.pad_token_id), 4,
                               torch.device("cpu"))
    batch = collate_unpaired(seqs[:4], tokenizer.pad_token_id, ours_ref)
    # the KL completions on the prompts' forward with gradients, or on a gradient-free pass of their own
    assert (batch.prompt_ids.shape[1] > 2 * batch.completion_ids.shape[1]) == (rows[0]["completion"][-1] != "s")
    with torch.no_grad():
        assert torch.allclose(completion_logps(policy, block(batch, 0))[0], trl_policy[0], atol=1e-5)
        assert torch.allclose(ours_ref[:, 0], trl_ref[0], atol=1e-5)
        if kl:
            assert torch.allclose(completion_logps(policy, block(batch, 1))[0], trl_policy[1], atol=1e-5)
            assert torch.allclose(ours_ref[:, 1], trl_ref[1], atol=1e-5)
    loss = KTOLoss(KTOObjective(loss_type, 0.3, 1.2, 1.0))
    got = loss(policy.train(), batch).mean()
    assert abs(float(got.detach()) - float(want.detach())) < 1e-6
    logged, metrics = loss.statistics.drain(), trainer._metrics["train"]
    assert logged.keys() == metrics.keys() - {"entropy", "num_tokens"}
    for name, value in logged.items():
        assert value == pytest.approx(metrics[name][0], rel=1e-6, abs=1e-5), name


@pytest.mark.parametrize("implicit", [False, True])
def test_unpairs_a_preference_file_as_trl(tmp_path, implicit):
    """A chosen/rejected file: the rows of TRL's unpair_preference_dataset, in its order (the chosen completions,
    then the rejected), after TRL's extract_prompt where the rows have no prompt."""
    data_utils = pytest.importorskip("trl.data_utils")
    datasets = pytest.importorskip("datasets")
    pairs = [{"prompt": f"Q{i}:", "chosen": f" good {i}", "rejected": f" bad {i}"} for i in range(5)]
    if implicit:
        pairs = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in pairs]
    got = read_unpaired(write_rows(tmp_path / "pairs.jsonl", pairs))
    dataset = datasets.Dataset.from_list(pairs)
    want = data_utils.unpair_preference_dataset(dataset.map(data_utils.extract_prompt) if implicit else dataset)
    assert [(ex.prompt, ex.completion, ex.label) for ex in got] == \
           [(w["prompt"], w["completion"], w["label"]) for w in want]


def test_a_dual_batch_halves_each_give_the_batch_loss():
    """MeZO's doubled batch: each half's losses, KL estimate included, are the batch's (no perturbation set)."""
    torch.manual_seed(0)
    model, tokenizer = pretrained.load("tiny-llama")
    modules = attach(model, None, r=4, alpha=8).modules
    for m in modules.values():
        torch.nn.init.normal_(m.lora_B, std=0.05)
    examples = [check_unpaired_row(("rows", i), row) for i, row in enumerate(sums_rows(6), 1)]
    seqs = encode_all(tokenizer, examples, 64, 3)
    loss = KTOLoss(KTOObjective(beta=0.5), reference=lambda: adapters_off(modules))
    batch = collate_unpaired(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        once, twice = loss(model, batch), loss(model, batch.doubled())
    assert twice.shape == (12,) and torch.allclose(twice[:6], once, atol=1e-6)
    assert torch.allclose(twice[6:], once, atol=1e-6)
    assert not torch.allclose(once, torch.full_like(once, 0.5))  # the adapter moved the policy off the reference


class OtherProcess:
    """A data-parallel world of two: this process and one whose sums are `other` (None: record this one's)."""

    world_size = 2

    def __init__(self, other: torch.Tensor | None = None):
        self.other, self.seen = other, None

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        self.seen = t.clone()
        return t + (self.other if self.other is not None else t)


def test_the_kl_estimate_and_metrics_are_over_every_process():
    """Two processes' batches: each row's loss reads the mean of the two KL estimates (clamped), and the logged
    means pool both processes' rows, as TRL's gathers do."""
    torch.manual_seed(0)
    model, tokenizer = pretrained.load("tiny-llama")
    ref = perturbed(model)
    examples = [check_unpaired_row(("rows", i), row) for i, row in enumerate(sums_rows(6), 1)]
    seqs = encode_all(tokenizer, examples, 64, 3)
    ref_logps = reference_logps(ref, seqs, lambda r: collate_unpaired(r, tokenizer.pad_token_id), 6,
                                torch.device("cpu"))
    a, b = (collate_unpaired(seqs[i:i + 3], tokenizer.pad_token_id, ref_logps[i:i + 3]) for i in (0, 3))
    objective = KTOObjective(beta=0.5)
    seen = {}
    with torch.no_grad():
        for name, batch in (("a", a), ("b", b)):
            recorder = OtherProcess()
            KTOLoss(objective, dist=recorder)(model, batch)
            seen[name] = recorder.seen[0]
        loss = KTOLoss(objective, dist=OtherProcess(seen["b"][None]))
        got = loss(model, a)
        ratios = completion_logps(model, block(a, 0))[0] - ref_logps[:3, 0]
    kl = ((seen["a"][0] + seen["b"][0]) / 2).clamp(min=0)
    assert torch.allclose(got, row_losses(objective, ratios, a.label, kl), atol=1e-6)
    both = seen["a"] + seen["b"]
    logged = loss.statistics.drain()
    assert logged["kl"] == pytest.approx(float(kl), abs=1e-6)
    assert logged["rewards/chosen"] == pytest.approx(float(both[2] / both[1]), abs=1e-6)
    assert logged["logps/rejected"] == pytest.approx(float(both[8] / both[6]), abs=1e-6)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("kto") / "rows.jsonl", sums_rows(8))


def kto(tmp_path, rows_file, *flags):
    return preference_run("kto", tmp_path / "run", rows_file, *flags)


@pytest.mark.parametrize("method", ["lora", "xgblora", "ft"])
def test_first_step_is_at_the_reference(tmp_path, rows_file, method):
    """Before the first update the policy is the reference, however it is had (LoRA: adapters off; XGBLoRA and full
    fine-tuning: precomputed): every log ratio and the KL estimate are 0, so each row's loss is 1 - sigmoid(0)."""
    _, logged = kto(tmp_path, rows_file, "--method", method, "--max_steps", "1")
    assert logged[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert logged[0][name] == pytest.approx(0, abs=1e-6), name


def test_zeroth_order_runs_the_same_loss(tmp_path, rows_file):
    """--trainer zo: the loss of the perturbed forwards, near the reference's 0.5 at the start."""
    results, logged = kto(tmp_path, rows_file, "--trainer", "zo", "--max_steps", "2", "--learning_rate", "1e-4")
    assert results["steps"] == 2 and all(abs(m["loss"] - 0.5) < 0.01 and "kl" in m for m in logged)


def test_training_moves_the_rewards_apart(tmp_path, rows_file, capsys):
    """The held-out margin between desirable and undesirable rows' rewards grows from 0; TRL's metrics are logged;
    report.html and kto.png draw them."""
    results, logged = kto(tmp_path, rows_file, "--max_steps", "10", "--learning_rate", "1e-2", "--beta", "0.5")
    assert results["eval_rewards/margins"] > 0.1 and results["eval_loss"] < 0.5
    assert results["num_train"] == 8 and results["num_desirable"] == 5
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                 "logits/chosen", "logits/rejected"):
        assert name in logged[-1], name
    assert (tmp_path / "run" / "kto.png").is_file() and "eval_kl" in (tmp_path / "run" / "report.html").read_text()


@pytest.mark.parametrize(("row", "field", "what"), [
    ({"prompt": "q", "completion": " a"}, "label", "missing: an unpaired preference row needs prompt, completion "
                                                   "and label"),
    ({"prompt": "q", "completion": " a", "label": "true"}, "label", 'expected true or false (whether the completion '
                                                                    'is desirable), got "true"'),
    ({"prompt": "q", "completion": " a", "label": 1}, "label", "expected true or false"),
    ({"prompt": "q", "label": True}, "completion", "missing"),
    ({"prompt": "q", "completion": "", "label": True}, "completion", "is an empty completion"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": " a", "label": True}, "completion",
     "mixes formats"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}],
      "label": False}, "completion[0].role", "'user' in a completion"),
])
def test_bad_rows_stop_before_the_model_loads(tmp_path, capsys, row, field, what):
    path = write_rows(tmp_path / "rows.jsonl", [{"prompt": "ok", "completion": " x", "label": True}, row])
    code = cli.main(["kto", "--model_name", "no-such-model-anywhere", "--train_file", path,
                     "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f'{path}:2: field "{field}": {what}' in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (("--per_device_train_batch_size", "1"), "must be 2 or more"),
    (("--beta", "0"), "--beta must be positive"),
    (("--undesirable_weight", "-1"), "--undesirable_weight must be 0 or more"),
    (("--trainer", "none"), "xgblora kto trains"),
])
def test_bad_options(tmp_path, rows_file, capsys, flags, message):
    code = cli.main(["kto", "--train_file", rows_file, "--output_dir", str(tmp_path / "out"), *flags])
    assert code == 2 and message in capsys.readouterr().err
