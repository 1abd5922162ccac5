"""CUDA out-of-memory in an AdamW step: the micro-batch is halved, the accumulation doubled, the gradient unchanged."""

from __future__ import annotations

import pytest
import torch
from helpers import adapter, make_cfg

from xgblora.config import Config
from xgblora.data.tasks import Example
from xgblora.distributed import LOCAL
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.optim import fo
from xgblora.recipes import sft
from xgblora.train import objective
from xgblora.train.loop import build_stepper
from xgblora.train.objective import causal_training_set, per_example_loss
from xgblora.train.setup import setup_method

WORDS = ["a fine film", "dull", "the best story of the year", "boring and bad", "funny", "I love it",
         "terrible acting, terrible plot", "great", "not good", "very much fun", "bad", "a good time"]
EXAMPLES = [Example(f"{w} It was", (" terrible", " great"), (i % 2,)) for i, w in enumerate(WORDS)]


def rows_over(limit: int):
    """A per_example_loss that raises CUDA's out-of-memory error on batches of more than `limit` rows."""
    def loss(model, batch, *objectives):
        if batch.input_ids.shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {batch.input_ids.shape[0]} rows)")
        return per_example_loss(model, batch, *objectives)
    return loss


def setup(method: str, classification: bool, **cfg_overrides):
    """tiny-opt without dropout, the method's trainable parameters, and a config of the step."""
    model, tokenizer = pretrained.random_model("tiny-opt", dropout=0.0, seed=1)
    cfg = Config(method=method, trainer="regular", max_grad_norm=0.0, lora_target_modules="q_proj,v_proj,fc1",
                 train_as_classification=classification, **cfg_overrides)
    method_ = setup_method(model, cfg)
    if method_.modules:  # B = 0 at the start would leave A without gradient: give every adapter weight one
        with torch.no_grad():
            for _, p in method_.named_params:
                p.normal_(0, 0.05)
    data = causal_training_set(tokenizer, EXAMPLES, 64, classification)
    return model, method_, cfg, data


@pytest.mark.parametrize(("method", "classification", "limit", "cfg_overrides", "sizes"), [
    ("ft", False, 3, {"per_device_train_batch_size": 8}, [4, 2]),
    ("lora", True, 7, {"per_device_train_batch_size": 7, "gradient_accumulation_steps": 2}, [4, 2]),
    ("xgblora", False, 4, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                           "xgblora_norm_penalty": 0.1, "xgblora_preset": "plain"}, [4]),  # every layer: all grads
], ids=["ft", "lora-classification-accum2", "xgblora-penalty-accum2"])
def test_split_step_has_the_gradient_of_the_whole_step(monkeypatch, method, classification, limit, cfg_overrides, sizes):
    model, method_, cfg, data = setup(method, classification, **cfg_overrides)
    size = cfg.per_device_train_batch_size
    # the first batch is small enough to pass; the second fails after it: its gradient must not count twice
    if cfg.gradient_accumulation_steps == 2:
        batches = [data.batch(range(3)), data.batch(range(3, 3 + size))]
    else:
        batches = [data.batch(range(size))]
    params = [p for _, p in method_.named_params]
    before = [p.detach().clone() for p in params]

    # reference: autograd over the whole batches, as one un-split step computes it
    reference = sum(per_example_loss(model, b).mean() / len(batches) for b in batches)
    if cfg.xgblora_norm_penalty:
        reference = reference + method_.boosting.norm_penalty(cfg.xgblora_norm_penalty)
    grads = torch.autograd.grad(reference, params, allow_unused=True)

    stepper = build_stepper(cfg, method_, lambda b: rows_over(limit)(model, b), LOCAL,
                            torch.device("cpu"))
    stepper.optimizer = torch.optim.SGD(params, lr=1.0)  # the update is the gradient itself
    feed = iter(batches)
    said = []
    monkeypatch.setattr(fo.log, "warning", lambda message, *args: said.append(message % args))
    loss = stepper.step(lambda: next(feed), lr=1.0)

    assert stepper.micro_batch == sizes[-1]
    assert [int(w.split("micro-batch ")[1].split()[0]) for w in said if "out of memory" in w] == sizes
    assert float(loss) == pytest.approx(float(reference.detach()), rel=1e-5)
    moved = 0
    for p, old, g in zip(params, before, grads, strict=True):
        expected = old - g if g is not None else old
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
        moved += int(g is not None and bool(g.abs().max() > 1e-4))
    assert moved > len(params) // 2  # the comparison is not between two untouched copies


def test_out_of_memory_at_one_example_is_a_user_error_with_advice():
    model, method_, cfg, data = setup("lora", False, per_device_train_batch_size=2)
    stepper = fo.AdamWStepper(method_.named_params, lambda b: rows_over(0)(model, b), micro_batch=2)
    with pytest.raises(UserError, match=r"CUDA out of memory with a micro-batch of 1 example .*"
                                        r"--gradient_checkpointing, --activation_offloading, a smaller --max_length, or --trainer zo"):
        stepper.step(lambda: data.batch([0, 1]), lr=1.0)


def test_run_with_out_of_memory_finishes_warns_once_and_trains_as_without(glue_data, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setitem(pretrained.RANDOM_MODELS, "tiny-opt",
                        (pretrained.RANDOM_MODELS["tiny-opt"][0], {**pretrained.RANDOM_MODELS["tiny-opt"][1], "dropout": 0.0}))
    cfg = dict(max_steps=6, logging_steps=1, save_strategy="no", no_eval=True)
    whole = sft.run(make_cfg(glue_data, tmp_path / "whole", **cfg))
    assert "out of memory" not in capsys.readouterr().err

    monkeypatch.setattr(objective, "per_example_loss", rows_over(5))
    split = sft.run(make_cfg(glue_data, tmp_path / "split", **cfg))
    err = capsys.readouterr().err
    assert err.count("CUDA out of memory") == 1 and "redoing the step with micro-batch 4" in err
    assert split["steps"] == whole["steps"] == 6
    assert split["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-4)
    for key, value in adapter(tmp_path / "whole").items():
        torch.testing.assert_close(adapter(tmp_path / "split")[key], value, rtol=1e-4, atol=1e-6)
