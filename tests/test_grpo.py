"""`xgblora grpo`: reward functions with TRL's interface, an interrupted run resumed exactly, MeZO's dual batch of
completions, XGBLoRA's merges during RL, option errors, and GRPO raising held-out accuracy after a short SFT."""

import copy
import dataclasses
import json
import math
import random

import pytest
import torch
from conftest import completion_batch
from helpers import killed_at_step, reference_z, step_seeds
from safetensors.torch import load_file

from xgblora.adapters.lora import attach
from xgblora.cli import main
from xgblora.config import Config, GRPOConfig
from xgblora.distributed import LOCAL
from xgblora.errors import UserError
from xgblora.export import export_run
from xgblora.generation import grpo_objective, rollout
from xgblora.generation.generate import Prompts
from xgblora.generation.grpo_objective import (
    GRPOLoss,
    GRPOObjective,
    completion_logprobs,
)
from xgblora.generation.rewards import Rewards
from xgblora.generation.rollout import Completions, Rollout
from xgblora.logs import read_metrics
from xgblora.optim.zo import MeZO
from xgblora.recipes import grpo as grpo_loop
from xgblora.recipes.grpo import run_grpo
from xgblora.recipes.sft import run


def _write_pairs(path, pairs):
    rows = [{"question": f"Which is larger, {a} or {b}?", "answer": f"#### {max(a, b)}", "level": a % 3}
            for a, b in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def data(tmp_path, monkeypatch):
    # a random model is never right: a reward it earns half the time (an odd first token) gives advantages
    (tmp_path / "parity_reward.py").write_text(
        "def odd_first(completion_ids, **kwargs):\n    return [float(ids[0] % 2) for ids in completion_ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)
    _write_pairs(tmp_path / "q.jsonl", pairs[:12])
    _write_pairs(tmp_path / "h.jsonl", pairs[12:16])
    return tmp_path


def _cfg(data, out, **options):
    base = dict(model_name="tiny-llama", train_file=str(data / "q.jsonl"), eval_file=str(data / "h.jsonl"),
                columns="prompt=question,completion=answer", method="lora", learning_rate=1e-2, max_new_tokens=4,
                num_return_sequences=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                max_steps=6, logging_steps=1, save_strategy="no", device="cpu", seed=3, output_dir=str(data / out),
                reward_funcs=["gsm8k", "parity_reward:odd_first"])
    return GRPOConfig(**{**base, **options})


def test_built_in_rewards_and_a_trl_style_user_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, completion_ids, level, **kwargs):\n"
        "    return [None if lv == 2 else float(len(ids) < 3) + lv for ids, lv in zip(completion_ids, level)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = Rewards(["gsm8k", "format:answer_tags", "my_rewards:short"], [1.0, 0.5, 2.0])
    completions = ["so #### 7", "<answer>7</answer> #### 8", "nothing"]
    out = rewards.score(["q"] * 3, completions, [[1, 2], [1, 2, 3], [4]],
                        {"reference": ["#### 7"] * 3, "level": [0, 1, 2]}, ["q.jsonl:1"] * 3)
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0] and out[:, 1].tolist() == [0.0, 1.0, 0.0]
    assert out[:2, 2].tolist() == [1.0, 1.0] and torch.isnan(out[2, 2])
    assert rewards.total(out).tolist() == [3.0, 2.5, 0.0] and rewards.accuracy_index == 0


def test_a_conversational_prompt_reaches_reward_functions_as_messages():
    seen = {}

    def record(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    run = Rollout.__new__(Rollout)  # only score() and what it reads
    run.cfg, run.rewards = GRPOConfig(train_file="x", columns=None), Rewards(["gsm8k"])
    run.rewards.funcs = [record]
    prompts = Prompts(rows=[{"messages": [{"role": "user", "content": "hi"}]}], examples=[_example()], ids=[[1]])
    run.score(prompts, [0], Completions(["hello"], [[5]], torch.zeros(1, dtype=torch.bool)), None)
    assert seen["prompts"] == [[{"role": "user", "content": "hi"}]]
    assert seen["completions"] == [[{"role": "assistant", "content": "hello"}]]


def _example():
    from xgblora.data.tasks import Example

    return Example("", (), (), messages=(("user", "hi"),))


@pytest.mark.parametrize("spec", ["nope", "format:nope", "no_such_module_xyz:f"])
def test_bad_reward_functions_are_user_errors(spec):
    with pytest.raises(UserError, match="--reward_funcs"):
        Rewards([spec])


def test_an_interrupted_run_resumes_exactly(data, monkeypatch):
    """Two optimizer steps per generation batch, two passes over it (a generation every 4 steps), beta > 0; killed
    after the checkpoint at step 3, in the middle of a generation batch, and resumed: the same adapter and logs."""
    options = dict(generation_batch_size=16, num_iterations=2, beta=0.1, save_strategy="steps", save_steps=3,
                   epsilon_high=0.28, eval_file=None)
    whole = run_grpo(_cfg(data, "whole", **options))
    with killed_at_step(monkeypatch, 5), pytest.raises(KeyboardInterrupt):
        run_grpo(_cfg(data, "parts", **options))
    resumed = run_grpo(_cfg(data, "parts", resume_from_checkpoint="latest", **options))
    assert resumed["resumes"] == 1 and whole["generation_batches"] == 2
    a, b = (load_file(str(data / name / "final" / "adapter_model.safetensors")) for name in ("whole", "parts"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # it trained
    logs = [[json.loads(line) for line in (data / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("whole", "parts")]
    drop = ("elapsed_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in logs[0]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in logs[1]]
    assert {"reward", "rewards/gsm8k", "rewards/parity_reward:odd_first", "accuracy", "completion_length", "clip_ratio", "kl", "entropy"} <= set(logs[0][1])


def test_an_interrupted_es_run_on_rewards_resumes_exactly(data, monkeypatch):
    """--zo_objective reward: the prompts of each step, the members' sampling seed and the estimator's seeds come
    back with the checkpoint, so a run killed after step 2 and resumed ends with the uninterrupted run's adapter."""
    options = dict(trainer="zo", zo_objective="reward", zo_estimator="es", zo_queries=2, zo_eps=0.05,
                   gradient_accumulation_steps=1, max_steps=4, save_strategy="steps", save_steps=2, eval_file=None)
    run_grpo(_cfg(data, "whole", **options))
    with killed_at_step(monkeypatch, 3), pytest.raises(KeyboardInterrupt):
        run_grpo(_cfg(data, "parts", **options))
    resumed = run_grpo(_cfg(data, "parts", resume_from_checkpoint="latest", **options))
    a, b = (load_file(str(data / name / "final" / "adapter_model.safetensors")) for name in ("whole", "parts"))
    assert resumed["resumes"] == 1 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)


def test_a_generation_batch_is_shuffled_by_whole_groups(data):
    """The rows of a group stay adjacent, so a micro-batch holds whole groups (and a prompt's forward serves its
    completions in the loss)."""
    _, source = grpo_loop.prepare(_cfg(data, "groups", generation_batch_size=16, eval_file=None))
    prompt_of_row = source.generate().batch.prompt_id.view(-1, 4)  # 4 groups of G = 4
    assert (prompt_of_row == prompt_of_row[:, :1]).all() and len(set(prompt_of_row[:, 0].tolist())) == 4


def test_xgblora_merges_its_boosters_during_rl(data):
    done = run_grpo(_cfg(data, "xgb", method="xgblora", max_steps=4, xgblora_steps_per_iteration=2))
    assert done["boosters"] == 2
    page = (data / "xgb" / "report.html").read_text()
    assert "GRPO report" in page and "eval_pass@1" in page and (data / "xgb" / "grpo.png").stat().st_size > 0


def test_mezo_estimates_the_grpo_loss_from_a_dual_batch_as_from_two_passes():
    """Under --trainer zo with adapters, L+ and L- come from one forward over the doubled batch of completions:
    they equal the two-pass estimate (weights perturbed in place) for the same seed."""
    from xgblora.models import pretrained

    losses = []
    for dual in (True, False):
        torch.manual_seed(0)  # the same base and adapter both times
        model, tokenizer = pretrained.load("tiny-llama")
        report = attach(model, None, r=2, alpha=4)
        for m in report.modules.values():
            m.lora_B.data.normal_(generator=torch.Generator().manual_seed(0))
        # two completions of one prompt: the dual batch's halves must not share its forward
        rows = [(0, (5, 6, 7), (8, 9)), (1, (11,), (12, 13, 14)), (0, (5, 6, 7), (15,))]
        batch = completion_batch(rows, tokenizer.pad_token_id, nll_weight=torch.tensor([0.5, 1 / 3, 1.0]),
                                 advantages=torch.tensor([1.0, -1.0, 0.5]))
        with torch.no_grad():
            old, _ = completion_logprobs(model, batch, 1.0)
        batch = dataclasses.replace(batch, old_logps=old - 0.1 * batch.target_mask, ref_logps=old)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        mezo = MeZO(named, lr=1e-3, eps=1e-2, dual_modules=report.modules if dual else None, seed=7)
        with torch.no_grad():
            losses.append(mezo.step(GRPOLoss(model, GRPOObjective(beta=0.1), 1.0), batch))
    assert losses[0][0] != losses[0][1]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_a_continued_adapter_is_its_own_kl_reference(data):
    """GRPO on top of a trained adapter (SFT -> GRPO): the reference of --beta is that adapter, frozen, as TRL's copy
    of the starting model, so the KL is 0 at the first step (the policy is the reference) and grows after."""
    from peft import LoraConfig, get_peft_model

    from xgblora.models import pretrained

    torch.manual_seed(0)
    peft = get_peft_model(pretrained.load("tiny-llama")[0],
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(data / "sft-adapter")  # B random: far from the base model
    run_grpo(_cfg(data, "continued", adapter=str(data / "sft-adapter"), beta=0.04, max_steps=2, eval_file=None))
    kl = [r["kl"] for r in read_metrics(data / "continued" / "metrics.jsonl") if "kl" in r]
    assert len(kl) == 2 and abs(kl[0]) < 1e-7 and kl[1] > 1e-6


def _adapted(folder) -> set[str]:
    """The module names a saved PEFT adapter adapts."""
    names = load_file(str(folder / "adapter_model.safetensors"))
    return {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in names}


def test_lora_adapts_every_linear_layer_by_default_and_a_continued_adapter_its_own(data):
    """GRPO's default targets are PEFT's all-linear (every linear layer of the blocks, not the LM head); a continued
    adapter keeps its modules (as TRL trains a PEFT model's own); method ft has none to choose."""
    from peft import LoraConfig, get_peft_model

    from xgblora.models import pretrained

    peft = get_peft_model(pretrained.load("tiny-llama")[0], LoraConfig(r=4, target_modules="all-linear"))
    expected = {name.removeprefix("base_model.model.") for name, module in peft.named_modules()
                if hasattr(module, "lora_A") and "base_model.model." in name}
    assert len(expected) == 7 * 2  # seven linear layers in each of tiny-llama's two blocks
    run_grpo(_cfg(data, "default", max_steps=1, eval_file=None))
    assert _adapted(data / "default" / "final") == expected
    peft = get_peft_model(pretrained.load("tiny-llama")[0], LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft.save_pretrained(data / "sft")
    run_grpo(_cfg(data, "continued", adapter=str(data / "sft"), max_steps=1, eval_file=None))
    assert _adapted(data / "continued" / "final") == _adapted(data / "sft")
    assert _cfg(data, "ft", method="ft").lora_target_modules is None


@pytest.mark.parametrize("options", [dict(policy_loss="bnpo", importance_sampling_level="sequence"),
                                     dict(policy_loss="cispo", epsilon_high=5.0, trainer="zo")],
                         ids=["bnpo-gspo-adamw", "cispo-mezo"])
def test_the_newer_objectives_train_under_both_trainers(data, options):
    """GSPO's sequence-level ratios, bnpo's micro-batch weights and cispo (its own clip statistic) in the loop:
    two optimizer steps per generation batch, so the old log-probabilities are used; the adapter moves."""
    accumulation = 1 if options.get("trainer") == "zo" else 2
    run_grpo(_cfg(data, options["policy_loss"], max_steps=2, generation_batch_size=16, eval_file=None,
                  gradient_accumulation_steps=accumulation, **options))
    weights = load_file(str(data / options["policy_loss"] / "final" / "adapter_model.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)
    logged = [r for r in read_metrics(data / options["policy_loss"] / "metrics.jsonl") if "loss" in r]
    assert len(logged) == 2 and ("cispo_clip_ratio" in logged[0]) == (options["policy_loss"] == "cispo")


def test_mezo_trains_the_adapter(data):
    done = run_grpo(_cfg(data, "zo", trainer="zo", gradient_accumulation_steps=1, max_steps=2))
    weights = load_file(str(data / "zo" / "final" / "adapter_model.safetensors"))
    assert done["steps"] == 2 and any(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)


def test_es_on_rewards_steps_by_each_perturbed_policys_own_z_scored_rewards(data):
    """--zo_objective reward, --zo_estimator es (Qiu et al., es_ops.apply_update on z-scored rewards): each member
    theta +- eps z_i answers the step's prompts greedily, here by transformers' generate on a copy of the model, and
    is scored; theta -= lr / N sum_m zscore(L_m) e_m over the N = 2n members, L_m minus the member's mean reward."""
    (data / "graded_reward.py").write_text(
        "def first_mod7(completion_ids, **kwargs):\n    return [float(ids[0] % 7) for ids in completion_ids]\n")
    lr, eps, n = 0.1, 0.05, 3
    cfg = _cfg(data, "es", trainer="zo", zo_objective="reward", zo_estimator="es", zo_queries=n, zo_eps=eps,
               learning_rate=lr, temperature=0.0, num_return_sequences=1, gradient_accumulation_steps=1, max_steps=1,
               reward_funcs=["graded_reward:first_mod7"], eval_file=None)
    trainer, source = grpo_loop.prepare(cfg)
    named = [(name, p) for name, p in trainer.run.model.named_parameters() if p.requires_grad]
    theta = [p.detach().clone() for _, p in named]
    reference = copy.deepcopy(trainer.run.model)
    batches = []
    sampled = source.policy_rewards
    source.policy_rewards = lambda batch: batches.append(batch) or sampled(batch)
    trainer.fit()

    prompts = [torch.tensor([source.prompts.ids[i]]) for i in batches[0].indices]
    params = dict(reference.named_parameters())

    def mean_reward(values: list[torch.Tensor]) -> float:
        with torch.no_grad():
            for (name, _), value in zip(named, values, strict=True):
                params[name].copy_(value)
        answers = [reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                                      do_sample=False)[0, ids.shape[1]:] for ids in prompts]
        return sum(float(int(a[0]) % 7) for a in answers) / len(answers)

    members = [(sign, reference_z(theta, s)) for s in step_seeds(cfg.seed, n) for sign in (1.0, -1.0)]
    losses = torch.tensor([-mean_reward([t + sign * eps * zi for t, zi in zip(theta, z, strict=True)])
                           for sign, z in members], dtype=torch.float64)
    assert len(batches) == 2 * n and len(set(losses.tolist())) > 1  # the members answered differently
    shaped = (losses - losses.mean()) / (losses.std(unbiased=False) + 1e-8)
    for k, (_, p) in enumerate(named):
        expected = theta[k] - lr / len(members) * sum(float(a) * sign * z[k]
                                                      for a, (sign, z) in zip(shaped, members, strict=True))
        torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=0)
    assert any(not torch.equal(p.detach(), t) for (_, p), t in zip(named, theta, strict=True))
    logged = next(r for r in read_metrics(data / "es" / "metrics.jsonl") if "loss" in r)
    assert logged["reward"] == pytest.approx(-float(losses.mean()))
    assert logged["member_reward_std"] == pytest.approx(float(losses.std(unbiased=False)))


@pytest.mark.parametrize(("sampling", "queries"), [("antithetic", 2), ("independent", 5)])
def test_es_members_sampled_together_step_as_members_sampled_one_by_one(data, monkeypatch, sampling, queries):
    """--zo_member_batch 3: the population sampled 3 members at a time (and a remainder), each row of a generation
    on its own member's adapter, ends with the adapter and logs the statistics of members sampled one by one (at a
    temperature: every member draws from the same per-prompt seeds), in fewer generations."""
    generations = []
    completions = Rollout.completions
    monkeypatch.setattr(Rollout, "completions", lambda *a, **k: generations.append(1) or completions(*a, **k))
    options = dict(trainer="zo", zo_objective="reward", zo_estimator="es", zo_es_sampling=sampling,
                   zo_queries=queries, zo_eps=0.05, temperature=1.0, num_return_sequences=2,
                   gradient_accumulation_steps=1, max_steps=2, eval_file=None)
    adapters, logs, counts = [], [], []
    for batch in (1, 3):
        generations.clear()
        run_grpo(_cfg(data, f"members{batch}", zo_member_batch=batch, **options))
        counts.append(len(generations))
        adapters.append(load_file(str(data / f"members{batch}" / "final" / "adapter_model.safetensors")))
        logs.append([r for r in read_metrics(data / f"members{batch}" / "metrics.jsonl") if "loss" in r])
    members = 2 * queries if sampling == "antithetic" else queries
    assert counts == [2 * members, 2 * math.ceil(members / 3)]
    one, together = adapters
    assert one.keys() == together.keys() and any(v.abs().sum() > 0 for k, v in one.items() if "lora_B" in k)
    for k in one:
        torch.testing.assert_close(together[k], one[k], atol=1e-6, rtol=0, msg=k)
    for a, b in zip(*logs, strict=True):
        assert b["member_reward_std"] > 0 and b["member_reward_std"] == pytest.approx(a["member_reward_std"])
        assert (b["reward"], b["loss"]) == pytest.approx((a["reward"], a["loss"]))


def test_a_prompt_without_a_reference_is_a_one_line_error_naming_its_row(data, capsys):
    (data / "noref.jsonl").write_text('{"prompt": "1 or 2?", "completion": "#### 2"}\n{"prompt": "3 or 4?"}\n')
    code = main(["grpo", "--model_name", "tiny-llama", "--train_file", str(data / "noref.jsonl"),
                 "--output_dir", str(data / "bad"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "noref.jsonl:2" in err and "reference" in err


@pytest.mark.parametrize("flags, message", [
    (["--generation_batch_size", "12"], "multiple of the optimizer batch"),
    (["--num_generations", "3"], "multiple of --num_generations 3"),
    (["--temperature", "0"], "temperature"),
    (["--num_generations", "1", "--per_device_train_batch_size", "1"], "at least 2"),
    (["--reward_funcs", "gsm8k", "format:gsm8k", "--reward_weights", "1"], "--reward_weights"),
    (["--zo_objective", "reward"], "needs --trainer zo"),
    (["--trainer", "zo", "--zo_objective", "reward", "--beta", "0.1"], "drop --beta"),
    (["--trainer", "zo", "--zo_objective", "reward", "--num_iterations", "2"], "anew"),
    (["--trainer", "zo", "--zo_objective", "reward", "--zo_dual", "true"], "drop --zo_dual"),
    (["--trainer", "zo", "--zo_estimator", "es", "--zo_member_batch", "2"], "sample their own completions"),
    (["--trainer", "zo", "--zo_objective", "reward", "--zo_estimator", "es", "--zo_member_batch", "2", "--method",
      "ft"], "an adapter method"),
    (["--trainer", "zo", "--zo_objective", "reward", "--zo_estimator", "es", "--zo_member_batch", "0"],
     "at least 1"),
])
def test_bad_options_are_one_line_errors(data, capsys, flags, message):
    code = main(["grpo", "--model_name", "tiny-llama", "--train_file", str(data / "q.jsonl"), "--columns",
                 "prompt=question,completion=answer", "--output_dir", str(data / "bad"), "--device", "cpu", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize(("flags", "training"), [({}, True), ({"disable_dropout": True}, False)])
def test_dropout_applies_in_the_loss_unless_disabled(data, monkeypatch, flags, training):
    """As TRL's GRPO (disable_dropout false by default), the loss's forwards and the old and reference
    log-probabilities run in train mode, with the model's dropout; --disable_dropout takes it out."""
    seen = []
    original = grpo_objective.completion_logprobs

    def recording(model, *args, **kwargs):
        seen.append(model.training)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(grpo_objective, "completion_logprobs", recording)
    monkeypatch.setattr(rollout, "completion_logprobs", recording)
    trainer, _ = grpo_loop.prepare(_cfg(data, "dropout", max_steps=2, num_iterations=2, beta=0.1, eval_file=None,
                                        **flags))
    trainer.fit()
    assert len(seen) > 2 and set(seen) == {training}  # the loss's, the old and the reference passes


@pytest.mark.parametrize("policy_loss", ["dapo", "bnpo", "dr_grpo", "cispo", "grpo"])
def test_sequence_level_ratios_warn_outside_gspos_loss(data, xgblora_log, policy_loss):
    """Sequence-level importance ratios with a loss that adds up token terms weigh each completion by its length:
    not GSPO's objective (--policy_loss grpo), said once when the run is set up, as TRL says it."""
    cap = {"epsilon_high": 5.0} if policy_loss == "cispo" else {}  # CISPO's ratio cap (ScaleRL's 5)
    grpo_loop.prepare(_cfg(data, "gspo", importance_sampling_level="sequence", policy_loss=policy_loss, **cap))
    warned = [r.getMessage() for r in xgblora_log.records if r.name == "xgblora" and r.levelname == "WARNING"]
    if policy_loss == "grpo":
        assert not any("--importance_sampling_level" in m for m in warned)
    else:
        assert len(warned) == 1 and f"--policy_loss {policy_loss}" in warned[0] and "--policy_loss grpo" in warned[0]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_grpo_raises_the_verified_reward_after_a_short_sft(tmp_path, seed):
    """Which-is-larger questions in GSM8K's answer format (RFT's task): SFT on 15 of them leaves tiny-llama right on
    some questions and wrong on others; 60 GRPO steps on 60 questions (G = 8, two prompts per step, the gsm8k
    correctness reward) then earn more reward on them: the mean of the last 20 steps' rewards over the first 20.

    What GRPO optimises, measured on its own samples (320 a window). Greedy pass@1 on 30 held-out questions is too
    coarse for a test here: a question moves it by 0.03, and runs whose sums differ only in rounding (two CPUs) end
    0.1-0.3 apart. Measured rises at this rate: 0.04-0.08 (seeds 0-3, an Intel Xeon); the margin asked is 0.02.
    A rate of 1e-3 collapsed the reward to 0 on three of those seeds."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)
    _write_pairs(tmp_path / "sft.jsonl", pairs[:15])
    _write_pairs(tmp_path / "questions.jsonl", pairs[:60])
    _write_pairs(tmp_path / "heldout.jsonl", pairs[60:])
    common = dict(eval_file=str(tmp_path / "heldout.jsonl"), method="ft", save_strategy="no",
                  columns="prompt=question,completion=answer", max_new_tokens=6, device="cpu", seed=seed)
    run(Config(model_name="tiny-llama", task_name="custom", train_file=str(tmp_path / "sft.jsonl"),
               output_dir=str(tmp_path / "sft"), per_device_train_batch_size=16, learning_rate=3e-3, max_steps=60,
               no_eval=True, **common))
    export_run(tmp_path / "sft", "merged", tmp_path / "sft-merged")
    done = run_grpo(GRPOConfig(model_name=str(tmp_path / "sft-merged"), train_file=str(tmp_path / "questions.jsonl"),
                               output_dir=str(tmp_path / "grpo"), learning_rate=5e-4, max_steps=60, logging_steps=1,
                               per_device_train_batch_size=16, num_return_sequences=8, **common))
    assert 0 < done["before_eval_pass@1"] < 1  # right on some held-out questions, wrong on others
    rewards = [r["reward"] for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r]
    assert len(rewards) == 60
    assert sum(rewards[-20:]) / 20 >= sum(rewards[:20]) / 20 + 0.02


def _trl_rewards(per_function, weights, group, scale_rewards, aggregation):
    """TRL's advantages and reward logs of one generation batch (`_generate_and_score_completions`), line by line
    from its source, with its nanstd."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(per_function).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (per_function * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
        if scale_rewards in ("group", "none"):
            std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
        else:
            std = nanstd(rewards).expand_as(rewards)
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = per_function.view(-1, group, per_function.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, per_function.shape[1]) * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    logged = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    logged[unscorable] = torch.nan
    metrics = {"reward": torch.nanmean(logged).item(), "reward_std": nanstd(logged).item(),
               "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}
    for i in range(per_function.shape[1]):
        metrics[f"{i}/mean"], metrics[f"{i}/std"] = (torch.nanmean(per_function[:, i]).item(),
                                                     nanstd(per_function[:, i]).item())
    return torch.nan_to_num(adv, nan=0.0), metrics


@pytest.mark.parametrize("aggregation, scale_rewards", [("sum_then_normalize", "group"),
                                                        ("sum_then_normalize", "batch"),
                                                        ("sum_then_normalize", "none"),
                                                        ("normalize_then_sum", "group")])
def test_rewards_advantages_and_their_logs_equal_trls(aggregation, scale_rewards):
    """Three groups of 4, two weighted reward functions, one completion unscored by both (None) and one by the
    second: the advantages and the logged reward, reward_std, frac_reward_zero_std and each function's mean and
    std equal TRL's, NaN-aware as TRL (a torch.std of the totals would be NaN)."""
    nan = float("nan")
    per_function = torch.tensor([[1.0, 0.5], [1.0, 0.5], [nan, nan], [1.0, 0.5],  # no spread: 0 std
                                 [0.0, 1.0], [1.0, nan], [1.0, 0.0], [0.0, 0.0],
                                 [2.0, 1.0], [0.0, 1.0], [1.0, 0.0], [3.0, 1.0]])
    run = Rollout.__new__(Rollout)  # only rewarded() and what it reads
    run.cfg = GRPOConfig(train_file="x", scale_rewards=scale_rewards, multi_objective_aggregation=aggregation)
    run.rewards = Rewards(["gsm8k", "format:gsm8k"], [1.0, 0.5])
    run.group, run.dist, run.device, run.agent = 4, LOCAL, torch.device("cpu"), None
    run.score = lambda *args: per_function
    done = Completions([""] * 12, [[1]] * 12, torch.zeros(12, dtype=torch.bool))
    _, ours, logged = run.rewarded(None, [0, 1, 2], done, None, 1)
    theirs, metrics = _trl_rewards(per_function, run.rewards.weights, 4, scale_rewards, aggregation)
    assert torch.allclose(ours, theirs, atol=1e-6) and ours.abs().sum() > 0
    for key in ("reward", "reward_std", "frac_reward_zero_std"):
        assert logged[key] == pytest.approx(metrics[key], abs=1e-6), key
    for i, name in enumerate(run.rewards.names):
        assert logged[f"rewards/{name}"] == pytest.approx(metrics[f"{i}/mean"], abs=1e-6)
        assert logged[f"rewards/{name}/std"] == pytest.approx(metrics[f"{i}/std"], abs=1e-6)


BAD_REWARDS = {
    "raises": ("def f(completions, **kw):\n    return {}['level']\n", "raised KeyError: 'level'"),
    "a number": ("def f(completions, **kw):\n    return 1.0\n", "returned 1.0 (float)"),
    "too few": ("def f(completions, **kw):\n    return [1.0]\n", "returned 1 rewards for 2 completions"),
    "a string": ("def f(completions, **kw):\n    return [1.0, 'yes']\n", "q.jsonl:7: reward function bad:f returned 'yes'"),
    "infinite": ("def f(completions, **kw):\n    return [float('inf'), 0.0]\n", "q.jsonl:3: reward function bad:f returned inf"),
}


@pytest.mark.parametrize("case", BAD_REWARDS)
def test_a_reward_function_that_fails_is_one_line_naming_it_and_the_row(tmp_path, monkeypatch, case):
    source, message = BAD_REWARDS[case]
    module = f"bad_{case.replace(' ', '_')}"  # a module of its own per case (imports are cached)
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = Rewards([f"{module}:f"])
    with pytest.raises(UserError) as error:
        rewards.score(["q", "q"], ["a", "b"], [[1], [2]], {}, ["q.jsonl:3", "q.jsonl:7"])
    text = str(error.value).replace(module, "bad")
    assert message in text and "reward function bad:f" in text and "q.jsonl:" in text
    assert "\n" not in str(error.value)


def test_reward_funcs_import_from_the_current_folder(tmp_path, monkeypatch):
    """`--reward_funcs mymodule:fn` finds mymodule.py where the command runs, as `rft --verifier` does (the console
    script's sys.path holds its own folder, not the current one)."""
    (tmp_path / "here_rewards.py").write_text("def fn(completions, **kw):\n    return [0.5] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", str(tmp_path))])
    rewards = Rewards(["here_rewards:fn"])
    assert rewards.score(["q"], ["a"], [[1]], {}, ["q.jsonl:1"]).tolist() == [[0.5]]


def test_rewards_that_score_nothing_stop_the_run_in_one_line(data, capsys):
    (data / "none_reward.py").write_text("def nothing(completions, **kw):\n    return [None] * len(completions)\n")
    code = main(["grpo", "--model_name", "tiny-llama", "--train_file", str(data / "q.jsonl"), "--columns",
                 "prompt=question,completion=answer", "--output_dir", str(data / "nan"), "--device", "cpu",
                 "--reward_funcs", "none_reward:nothing", "--num_generations", "2", "--per_device_train_batch_size",
                 "2", "--max_new_tokens", "2", "--max_steps", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "q.jsonl:" in err[-1] and "returned None or NaN for all 2 completions" in err[-1]


def test_reward_functions_get_trainer_state_log_extra_and_log_metric_as_in_trl(data):
    """A TRL reward function that names trainer_state (no default), log_extra and log_metric: it sees the step,
    its metric is averaged into metrics.jsonl, its column is shown with the logged completions."""
    (data / "trl_style.py").write_text(
        "SEEN = []\n"
        "def scheduled(completions, trainer_state, log_extra, log_metric, **kwargs):\n"
        "    SEEN.append(trainer_state.global_step)\n"
        "    log_metric('my_metric', 2.0 * trainer_state.global_step)\n"
        "    log_extra('note', [f'c{i}' for i in range(len(completions))])\n"
        "    return [float(len(c) % 2) for c in completions]\n")
    run_grpo(_cfg(data, "trl-style", reward_funcs=["trl_style:scheduled"], max_steps=2, eval_file=None,
                  gradient_accumulation_steps=1, log_completions=True))
    import trl_style

    records = [r for r in read_metrics(data / "trl-style" / "metrics.jsonl") if "loss" in r]
    assert trl_style.SEEN == [0, 1]
    assert [r["my_metric"] for r in records] == [0.0, 2.0]
    assert [s["note"] for s in records[0]["samples"]] == ["c0", "c1", "c2", "c3"]


def test_string_prompts_are_sent_raw_as_trl_and_conversations_get_the_template(tmp_path):
    """TRL tokenizes a string prompt as it is (`processing_class(text=prompts)`) and renders a conversational one
    with the chat template and a generation prompt; --raw_prompts false keeps the other way (a string as a user
    turn)."""
    from xgblora.models import pretrained

    tokenizer = pretrained.load("tiny-llama-chat")[1]
    question, messages = "Which is larger, 3 or 5?", [{"role": "user", "content": "Which is larger, 2 or 7?"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": question, "completion": "#### 5"}) + "\n"
                                      + json.dumps({"prompt": messages, "completion": "#### 7"}) + "\n")
    rewards, path = Rewards(["gsm8k"]), str(tmp_path / "p.jsonl")
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
    read = grpo_loop.read_grpo_prompts(GRPOConfig(train_file="x", max_length=512), path, tokenizer, rewards)
    assert read.ids == [tokenizer(text=question)["input_ids"], templated]
    as_turn = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    cfg = GRPOConfig(train_file="x", max_length=512, raw_prompts=False)
    assert grpo_loop.read_grpo_prompts(cfg, path, tokenizer, rewards).ids == [as_turn, templated]


BOOSTING = {
    "fixed": dict(xgblora_num_boosters=3),
    "restarted schedule": dict(xgblora_steps_per_iteration=2, xgblora_restart_schedule=True,
                               lr_scheduler_type="cosine", warmup_steps=1),
    # a threshold no loss meets: the EMA "stops improving" every 2 steps, whatever the losses (if the loop hands
    # them over: without a loss the adaptive merge only merges at its cap)
    "adaptive": dict(xgblora_adaptive=True, xgblora_adaptive_patience=2, xgblora_adaptive_threshold=1e9,
                     xgblora_adaptive_max_steps=5),
}


@pytest.mark.parametrize("options", BOOSTING.values(), ids=BOOSTING.keys())
def test_boosting_options_merge_and_schedule_as_in_train(data, options):
    """`grpo --method xgblora` runs `train`'s loop: each boosting option merges at the same steps and gives the same
    learning rate at every step as under `train`."""
    common = dict(model_name="tiny-llama", method="xgblora", learning_rate=1e-2, max_steps=6, logging_steps=1,
                  save_strategy="no", device="cpu", seed=3, **options)
    run(Config(task_name="custom", train_file=str(data / "q.jsonl"), columns="prompt=question,completion=answer",
               per_device_train_batch_size=2, no_eval=True, output_dir=str(data / "train"), **common))
    run_grpo(_cfg(data, "grpo", eval_file=None, **common))
    logs = {name: read_metrics(data / name / "metrics.jsonl") for name in ("train", "grpo")}
    merges = {name: [r["step"] for r in log if r.get("event") == "merge"] for name, log in logs.items()}
    rates = {name: [r["lr"] for r in log if "lr" in r] for name, log in logs.items()}
    assert merges["grpo"] == merges["train"] and len(merges["train"]) >= 2
    assert rates["grpo"] == rates["train"] and len(rates["train"]) == 6


def test_es_on_rewards_trains_when_a_reward_function_leaves_some_completions_unscored(data):
    """TRL's None ("not scored") for some completions: each member is scored by the mean over its scored ones, so
    the run trains on instead of stopping at a NaN loss."""
    (data / "some_reward.py").write_text(
        "def some(completion_ids, **kwargs):  # the first prompt's completions unscored, as a reference unparsed\n"
        "    half = len(completion_ids) // 2\n"
        "    return [None] * half + [float(ids[0] % 2) for ids in completion_ids[half:]]\n")
    cfg = _cfg(data, "es-none", trainer="zo", zo_objective="reward", zo_estimator="es", zo_queries=2, zo_eps=0.05,
               learning_rate=0.1, num_return_sequences=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
               max_steps=3, reward_funcs=["some_reward:some"], eval_file=None)
    calls = []
    real = grpo_loop.PolicyReward.__call__

    def spy(self, batch):
        rewards = self.source.policy_rewards
        self.source.policy_rewards = lambda b: calls.append(t := rewards(b)) or t
        try:
            return real(self, batch)
        finally:
            self.source.policy_rewards = rewards

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_loop.PolicyReward, "__call__", spy)
        run_grpo(cfg)
    assert any(torch.isnan(r).any() and not torch.isnan(r).all() for r in calls)  # some unscored, some scored
    losses = [r["loss"] for r in read_metrics(data / "es-none" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
