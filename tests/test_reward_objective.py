"""The reward model's tokens, loss and metrics against TRL's own RewardTrainer: the same tiny classifier and rows,
TRL's dataset preparation and DataCollatorForPreference beside ours, and `RewardTrainer.compute_loss` on its batch
beside `RewardLoss` on ours (values, gradients, logged metrics)."""

import json

import pytest
import torch

from xgblora.data.preference import (
    RewardSeq,
    check_margins,
    check_row,
    collate_rewards,
    read_preferences,
    reward_seqs,
)
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.preference.reward import RewardLoss, shares_prompts

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from trl.trainer.reward_trainer import DataCollatorForPreference  # noqa: E402

STANDARD = [{"prompt": "12+30=", "chosen": " 42", "rejected": " 43", "margin": 0.5},
            {"prompt": "Is it good? ", "chosen": "Yes, it was great.", "rejected": "No.", "margin": 0.0},
            {"prompt": "The movie", "chosen": " was great fun", "rejected": " was boring", "margin": 2.0}]
IMPLICIT = [{"chosen": "The movie was great fun", "rejected": "The movie was boring"},
            {"chosen": "Yes or No? Yes", "rejected": "Yes or No? No"}]
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5, I think"}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     "chosen": [{"role": "assistant", "content": "Hello"}], "rejected": [{"role": "assistant", "content": "Go away"}]}]
IMPLICIT_CONVERSATIONAL = [
    {"chosen": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}],
     "rejected": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "no"}]}]


def trl_trainer(model, tokenizer, rows, tmp_path, center=None):
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, use_cpu=True,
                            center_rewards_coefficient=center, save_strategy="no", logging_steps=1)
    return trl.RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)


def ours(tokenizer, rows, shared=False):
    examples = [check_row(("rows", i + 1), row) for i, row in enumerate(rows)]
    return collate_rewards(reward_seqs(tokenizer, examples, None), tokenizer.pad_token_id, shared)


def pad_with_eos(model, tokenizer):
    """The tokenizer pads with EOS, as many a causal LM's does: the classifier reads each sequence's last token that
    is not EOS (TRL tells the model the pad id)."""
    tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id


@pytest.mark.parametrize(("name", "rows", "center", "eos_pad"), [
    ("tiny-llama", STANDARD, None, False), ("tiny-llama", IMPLICIT, 0.01, False),
    ("tiny-llama-chat", CONVERSATIONAL, 0.1, False), ("tiny-llama-chat", IMPLICIT_CONVERSATIONAL, None, False),
    ("tiny-llama", STANDARD, 0.01, True)])
def test_loss_gradient_and_metrics_equal_trls(tmp_path, name, rows, center, eos_pad):
    """Whole sequences (TRL's batch), and each pair's shared prompt run once: TRL's loss, gradients and metrics."""
    model, tokenizer = pretrained.load(name, head="classifier", num_labels=1)
    if eos_pad:
        pad_with_eos(model, tokenizer)
    trainer = trl_trainer(model, tokenizer, rows, tmp_path, center)
    theirs_batch = DataCollatorForPreference(tokenizer.pad_token_id)(list(trainer.train_dataset))
    batch = ours(tokenizer, rows)
    assert torch.equal(batch.input_ids, theirs_batch["input_ids"])
    assert torch.equal(batch.attention_mask, theirs_batch["attention_mask"])
    model.train()
    theirs = trainer.compute_loss(model, dict(theirs_batch))
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(theirs, params)
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    shared = ours(tokenizer, rows, shared=True)
    assert shared.prompt_ids is not None and batch.prompt_ids is None
    assert shares_prompts(model, tokenizer.pad_token_id)
    grads = {}
    for kind, b in (("plain", batch), ("shared", shared)):
        loss = RewardLoss(center)
        got = loss(model, b).mean()
        grads[kind] = torch.autograd.grad(got, params)
        assert abs(got.item() - theirs.item()) < 1e-6, kind
        assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-5) for g, w in zip(grads[kind], want, strict=True)), kind
        logged = loss.statistics.drain()
        for metric in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
            assert logged[metric] == pytest.approx(metrics[metric], abs=1e-6), (kind, metric)
    assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-5)
               for g, w in zip(grads["shared"], grads["plain"], strict=True))


def test_the_shared_prompt_is_what_both_sequences_begin_with():
    """A pair's prompt is the tokens its sequences share (past the row's prompt where the completions begin
    alike); each rest keeps a token that is not padding; a pair sharing nothing, or a model that is no causal LM's
    classifier, runs whole sequences."""
    model, tokenizer = pretrained.load("tiny-llama", head="classifier", num_labels=1)
    seqs = [RewardSeq([1, 5, 6, 7, 2], [1, 5, 6, 8, 2]), RewardSeq([1, 9, 2], [1, 9, 4, 2])]
    batch = collate_rewards(seqs, 0, shared=True)
    assert batch.prompt_ids.tolist() == [[1, 5, 6], [0, 1, 9]]
    assert batch.completion_ids.tolist() == [[7, 2], [2, 0], [8, 2], [4, 2]]
    assert batch.n_tokens() == 5 + 2 + 1 + 2 + 2
    assert collate_rewards([RewardSeq([1, 5], [1, 5, 2])], 0, shared=True).completion_ids.tolist() == [[5, 0], [5, 2]]
    assert collate_rewards([RewardSeq([1, 5], [3, 5])], 0, shared=True).prompt_ids is None
    assert collate_rewards([RewardSeq([1, 5, 2], [1, 6, 2])], 2, shared=True).completion_ids.tolist() == [[5, 2], [6, 2]]
    assert collate_rewards([RewardSeq([1, 5, 2, 2], [1, 5, 7, 2])], 2, shared=True).prompt_ids is None  # only pads
    assert not shares_prompts(model, tokenizer.pad_token_id + 1)
    encoder, _ = pretrained.load("tiny-bert", head="classifier", num_labels=1)
    assert not shares_prompts(encoder, 0)


def test_the_margin_enters_the_loss():
    """Without the margin column the loss is TRL's plain -log sigmoid(r_c - r_r): the margins shift it."""
    model, tokenizer = pretrained.load("tiny-llama", head="classifier", num_labels=1)
    with_margin = ours(tokenizer, STANDARD)
    without = ours(tokenizer, [{k: v for k, v in row.items() if k != "margin"} for row in STANDARD])
    assert without.margin is None and torch.equal(with_margin.input_ids, without.input_ids)
    with torch.no_grad():
        rewards = model(input_ids=without.input_ids, attention_mask=without.attention_mask).logits[:, 0]
        chosen, rejected = rewards.chunk(2)
        gap = chosen - rejected
        assert torch.allclose(RewardLoss()(model, without), -torch.nn.functional.logsigmoid(gap), atol=1e-6)
        assert torch.allclose(RewardLoss()(model, with_margin),
                              -torch.nn.functional.logsigmoid(gap - torch.tensor([0.5, 0.0, 2.0])), atol=1e-6)


def test_the_shared_prompt_under_gradient_checkpointing():
    """--gradient_checkpointing keeps the prompt's cache (`enable_checkpointing`): the whole sequences' gradients."""
    from xgblora.models.checkpointing import enable_checkpointing

    model, tokenizer = pretrained.load("tiny-llama", head="classifier", num_labels=1)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(RewardLoss(0.01)(model, ours(tokenizer, STANDARD)).mean(), params)
    enable_checkpointing(model)
    got = torch.autograd.grad(RewardLoss(0.01)(model, ours(tokenizer, STANDARD, shared=True)).mean(), params)
    assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-5) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("shared", [False, True])
def test_halves_and_micro_batches(shared):
    """MeZO's dual batch scores its copy apart (the same losses twice); split micro-batches keep their pairs."""
    model, tokenizer = pretrained.load("tiny-llama", head="classifier", num_labels=1)
    batch = ours(tokenizer, STANDARD, shared)
    with torch.no_grad():
        whole = RewardLoss(0.01)(model, batch)
        assert torch.allclose(whole, RewardLoss(0.01)(model, ours(tokenizer, STANDARD, not shared)), atol=1e-6)
        assert torch.allclose(RewardLoss(0.01)(model, batch.doubled()), whole.repeat(2), atol=1e-6)
        parts = torch.cat([RewardLoss(0.01)(model, batch.split(i, i + 1)) for i in range(batch.n_examples)])
        assert torch.allclose(parts, whole, atol=1e-5)


def test_sequences_longer_than_max_length_are_dropped_as_trl_filters_them(tmp_path):
    model, tokenizer = pretrained.load("tiny-llama", head="classifier", num_labels=1)
    examples = [check_row(("rows", i + 1), row) for i, row in enumerate(STANDARD)]
    lengths = [max(len(s.chosen), len(s.rejected)) for s in reward_seqs(tokenizer, examples, None)]
    limit = sorted(lengths)[1]
    kept = reward_seqs(tokenizer, examples, limit)
    theirs = trl_trainer(model, tokenizer, STANDARD, tmp_path)  # TRL's default max_length 1024 keeps them all
    assert len(theirs.train_dataset) == 3
    assert len(kept) == sum(n <= limit for n in lengths) == 2
    with pytest.raises(UserError, match="every pair has a sequence longer than --max_length 1"):
        reward_seqs(tokenizer, examples, 1)


@pytest.mark.parametrize(("rows", "field", "what"), [
    ([{"prompt": "a", "chosen": " b"}], "rejected", "missing"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c", "margin": "big"}], "margin", "expected a finite number"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c", "margin": 1.0},
      {"prompt": "a", "chosen": " b", "rejected": " d"}], "margin", "missing: the rows before it give a margin"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"},
      {"prompt": "a", "chosen": " b", "rejected": " d", "margin": 1.0}], "margin", "the first row has none")])
def test_bad_rows_name_the_file_row_and_field(tmp_path, rows, field, what):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as err:
        check_margins(read_preferences(str(path)))
    message = str(err.value)
    assert f"{path}:{len(rows)}" in message and f'"{field}"' in message and what in message
    assert "\n" not in message


@pytest.mark.parametrize("shared", [False, True])
def test_the_first_order_head_under_mezo_trains_on_the_reward_loss(shared):
    """Under --trainer zo the score head trains by AdamW on the features MeZO's forwards recorded: the loss it takes
    from them (`TrainingLoss.head_loss`, two forwards stacked, as the estimator's) is RewardLoss's, and so is its
    gradient with respect to the head (the head on every position of whole sequences, or on each sequence's last
    token after its shared prompt)."""
    from xgblora.models.scoring import head_module
    from xgblora.train.head import recording_inputs
    from xgblora.train.objective import TrainingLoss

    model, tokenizer = pretrained.load("tiny-llama", head="classifier", num_labels=1)
    batch = ours(tokenizer, STANDARD, shared)
    training = TrainingLoss(model, preference=RewardLoss(0.01))
    head = head_module(model)
    want = RewardLoss(0.01)(model, batch).mean()
    want_grad, = torch.autograd.grad(want, head.weight)
    with torch.no_grad(), recording_inputs(head) as inputs:
        training(batch)
        training(batch)
    got = training.head_loss(head(torch.cat(inputs)), batch)
    got_grad, = torch.autograd.grad(got, head.weight)
    assert abs(got.item() - want.item()) < 1e-6
    assert torch.allclose(got_grad, want_grad, atol=1e-6)


def test_a_reward_model_scores_conversations_as_trls_grpo_trainer():
    """GRPOTrainer._calculate_rewards for a model among the reward functions, conversational prompts: TRL's
    apply_chat_template on prompt + completion, tokenised without special tokens, right-padded, the first logit;
    ours in forwards of two rows (so padding differs between them and TRL's one forward)."""
    from trl.data_utils import apply_chat_template

    from xgblora.generation.rewards import RewardModel

    model, tokenizer = pretrained.load("tiny-llama-chat", head="classifier", num_labels=1)
    model.eval()
    prompts = [[{"role": "user", "content": "What is 2+2?"}],
               [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
               [{"role": "user", "content": "Say yes or no, and why, at some length."}]]
    completions = [[{"role": "assistant", "content": text}] for text in ("4", "Hello there", "Yes")]
    texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"]
             for p, c in zip(prompts, completions, strict=True)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        want = model(**inputs).logits[:, 0]
    got = RewardModel("rm", model, tokenizer, batch_size=2)(prompts, completions)
    assert torch.allclose(torch.tensor(got), want, atol=1e-5) and want.std() > 0


def test_a_reward_model_comes_first_among_the_weighted_reward_sources():
    """TRL's script puts reward_model_name_or_path before the reward functions: its column is the first, weighted by
    the first --reward_weights value, and the total is the weighted sum."""
    from xgblora.generation.rewards import RewardModel, Rewards

    model, tokenizer = pretrained.load("tiny-llama", head="classifier", num_labels=1)
    rm = RewardModel("rm", model.eval(), tokenizer, batch_size=8)
    rewards = Rewards(["format:gsm8k"], [0.5, 2.0], reward_model=rm)
    prompts, completions = ["1+1=", "2+2="], [" #### 2", " four"]
    per_function = rewards.score(prompts, completions, [[1], [2]], {}, ["a:1", "a:2"])
    assert rewards.names == ["rm", "format:gsm8k"] and rewards.accuracy_index is None
    assert torch.allclose(per_function[:, 0], torch.tensor(rm(prompts, completions)))
    assert per_function[:, 1].tolist() == [1.0, 0.0]
    assert torch.allclose(rewards.total(per_function), 0.5 * per_function[:, 0] + 2.0 * per_function[:, 1])
