"""Padding-free packing: a packed batch gives the padded batch's losses and gradients, splits for out-of-memory
retries and doubles for dual MeZO like a padded one, and a model that lets packed sequences see each other is
refused."""

from __future__ import annotations

import pytest
import torch
from helpers import adapter, make_cfg

from xgblora.adapters.lora import attach
from xgblora.config import Config
from xgblora.data.splits import sample_splits
from xgblora.data.tasks import Example, get_task
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.models.scoring import packing_supported
from xgblora.optim import fo
from xgblora.optim.fo import micro_batches
from xgblora.optim.zo import MeZO
from xgblora.recipes import sft
from xgblora.train import setup
from xgblora.train.objective import causal_training_set, per_example_loss

# Instruction-style rows: answers of 1 to 9 tokens after prompts of very different lengths.
INSTRUCTIONS = [Example(p, (), (), answers=(a,)) for p, a in [
    ("Question: what is the best film of the year? Answer:", "the one about love and fun"),
    ("Q: yes or no? A:", "yes"),
    ("Summarise: a very long and boring story, dull acting, a bad plot, terrible music, no fun at all. Summary:",
     "bad"),
    ("Title: a good time. Text:", "a funny and well made movie, the best story we have seen"),
    ("Is it true?", "no"),
]]


def tiny_llama_with_lora():
    model, tokenizer = pretrained.random_model("tiny-llama", seed=2)
    modules = attach(model, r=4).modules
    torch.manual_seed(0)
    with torch.no_grad():  # B = 0 would leave A without gradient
        for m in modules.values():
            m.lora_B.normal_(0, 0.1)
    return model, tokenizer, modules


def sst2_rows(glue_data, n=12):
    cfg = Config(task_name="SST2", data_dir=str(glue_data), num_train=n, num_eval=1)
    return sample_splits(get_task("SST2", cfg.data), cfg.data).train


@pytest.mark.parametrize("rows", ["instructions", "sst2"])
def test_packed_batch_has_the_losses_and_gradients_of_the_padded_one(glue_data, rows):
    model, tokenizer, modules = tiny_llama_with_lora()
    examples = INSTRUCTIONS if rows == "instructions" else sst2_rows(glue_data)
    padded = causal_training_set(tokenizer, examples, 64, False)
    packed = causal_training_set(tokenizer, examples, 64, False, packed=True)
    assert packed.lengths == padded.lengths
    order = [3, 0, 4, 1, 2] if rows == "instructions" else [5, 2, 11, 0, 7, 3]
    a, b = padded.batch(order), packed.batch(order)
    assert b.input_ids.shape == (1, sum(packed.lengths[i] for i in order))  # not one padding token
    assert a.attention_mask.sum() == b.input_ids.numel()
    params = [p for m in modules.values() for p in (m.lora_A, m.lora_B)]
    loss_a, loss_b = per_example_loss(model, a), per_example_loss(model, b)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
    for ga, gb in zip(torch.autograd.grad(loss_a.mean(), params), torch.autograd.grad(loss_b.mean(), params),
                      strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


def test_split_packed_batch_pieces_have_the_whole_batchs_losses():
    model, tokenizer, _ = tiny_llama_with_lora()
    batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False, packed=True).batch(range(5))
    whole = per_example_loss(model, batch)
    pieces = list(micro_batches(batch, 2))
    assert [share for _, share in pieces] == [0.4, 0.4, 0.2]
    torch.testing.assert_close(torch.cat([per_example_loss(model, p) for p, _ in pieces]), whole)


def test_out_of_memory_on_a_packed_batch_halves_it_with_the_same_gradient(monkeypatch):
    model, tokenizer, modules = tiny_llama_with_lora()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False, packed=True).batch(range(5))
    params = [p for _, p in named]
    grads = torch.autograd.grad(per_example_loss(model, batch).mean(), params)
    before = [p.detach().clone() for p in params]

    def loss_fn(b):
        if b.target_weight.shape[1] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return per_example_loss(model, b)

    monkeypatch.setattr(fo.log, "warning", lambda *a: None)
    stepper = fo.AdamWStepper(named, loss_fn, max_grad_norm=0.0, micro_batch=5)
    stepper.optimizer = torch.optim.SGD(params, lr=1.0)  # the update is the gradient itself
    stepper.step(lambda: batch, lr=1.0)
    assert stepper.micro_batch == 2
    for p, old, g in zip(params, before, grads, strict=True):
        torch.testing.assert_close(p.detach(), old - g, rtol=1e-5, atol=1e-6)


def test_dual_mezo_on_a_packed_batch_equals_the_two_pass_step():
    steps = {}
    for dual in (False, True):
        model, tokenizer, modules = tiny_llama_with_lora()
        model.eval()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        zo = MeZO(named, lr=1e-2, eps=1e-3, dual_modules=modules if dual else None, seed=5)
        batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False, packed=True).batch(range(5))
        losses = zo.step(lambda b, model=model: per_example_loss(model, b), batch, lr=1e-2)
        steps[dual] = losses, [p.detach().clone() for _, p in named]
    assert steps[True][0] == pytest.approx(steps[False][0], rel=1e-5)
    for a, b in zip(steps[True][1], steps[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("autocast", [False, True])
def test_packing_support_is_detected(autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # bf16 rounding is no leak
        assert packing_supported(pretrained.random_model("tiny-llama")[0])  # its mask follows the position ids
        assert not packing_supported(pretrained.random_model("tiny-opt")[0])  # OPT's mask ignores them


@pytest.mark.parametrize("trainer", ["regular", "zo"])
def test_packed_run_trains_like_the_padded_run(glue_data, tmp_path, trainer):
    cfg = dict(model_name="tiny-llama", trainer=trainer, max_steps=6, save_strategy="no", no_eval=True,
               learning_rate=1e-2 if trainer == "zo" else 3e-3)
    padded = sft.run(make_cfg(glue_data, tmp_path / "padded", packing=False, **cfg))
    packed = sft.run(make_cfg(glue_data, tmp_path / "packed", packing=True, **cfg))
    assert packed["train_loss"] == pytest.approx(padded["train_loss"], rel=1e-4)
    # MeZO multiplies the losses' rounding differences by 1 / (2 eps) in its projected gradient
    atol = 1e-4 if trainer == "zo" else 1e-5
    trained = adapter(tmp_path / "packed")
    assert max(float(v.abs().max()) for k, v in trained.items() if "lora_B" in k) > 30 * atol  # B starts at 0
    for key, value in adapter(tmp_path / "padded").items():
        torch.testing.assert_close(trained[key], value, rtol=1e-3, atol=atol)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(model_name="tiny-opt"), r"--packing: this model \(opt, sdpa attention\) lets packed sequences attend"),
    (dict(model_name="tiny-llama", train_as_classification=True), r"--packing needs a causal LM trained on the gold"),
])
def test_packing_where_it_cannot_work_is_a_user_error(glue_data, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        sft.run(make_cfg(glue_data, tmp_path, packing=True, max_steps=1, **overrides))


def test_packing_defaults_off_with_sdpa(glue_data, tmp_path, monkeypatch):
    seen = []
    real = setup.causal_training_set
    monkeypatch.setattr(setup, "causal_training_set", lambda *a, **k: seen.append(k["packed"]) or real(*a, **k))
    sft.run(make_cfg(glue_data, tmp_path, model_name="tiny-llama", max_steps=1, save_strategy="no",
                       no_eval=True))
    assert seen == [False]
