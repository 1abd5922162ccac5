"""A classifier head MeZO can use: the linear probe (against its optimality conditions), and each --head_trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from xgblora.adapters.lora import attach
from xgblora.config import Config
from xgblora.data.labels import collate_labels, encode_labels
from xgblora.data.splits import sample_splits
from xgblora.data.tasks import Example, get_task
from xgblora.demo import sentiment_rows, write_data
from xgblora.distributed import LOCAL
from xgblora.evaluation import labels
from xgblora.models import pretrained
from xgblora.models.scoring import is_head_param
from xgblora.recipes import sft
from xgblora.train import head
from xgblora.train.loop import build_stepper
from xgblora.train.objective import TrainingLoss
from xgblora.train.setup import setup_method

WORDS = (" terrible", " great")


def _examples(n: int, seed: int = 0) -> list[Example]:
    return [Example(f"{r['text']} It was", WORDS, (r["label"],)) for r in sentiment_rows(n, seed)]


def _features_by_hand(model, tok, examples, pooling: str) -> torch.Tensor:
    """Each example alone through the encoder (no padding), pooled as the head reads it."""
    rows = []
    model.eval()  # a model built from its config starts in training mode (dropout)
    with torch.no_grad():
        for ex in examples:
            hidden = model.bert(input_ids=torch.tensor([tok(ex.prompt)["input_ids"]])).last_hidden_state[0]
            rows.append(hidden.mean(0) if pooling == "mean" else model.bert.pooler(hidden[None])[0])
    return torch.stack(rows)


def _objective_gradient(layer: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    weight, bias = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y) + 0.5 * l2 * weight.square().sum()
    loss.backward()
    return torch.cat([weight.grad.flatten(), bias.grad])


def test_probe_solves_the_regularised_logistic_regression_on_pooled_features():
    examples = _examples(48)
    for pooling in ("mean", "cls"):
        model, tok = pretrained.load("tiny-bert", head="classifier", num_labels=2)
        scoring = labels.build_scoring("classifier", tok, WORDS, pooling)
        x = _features_by_hand(model, tok, examples, pooling)
        y = torch.tensor([ex.gold[0] for ex in examples])
        layer = model.classifier
        assert _objective_gradient(layer, x, y, 1e-3).abs().max() > 1e-2  # the random head is no optimum
        l2, accuracy = head.fit_probe(model, tok, examples, scoring, l2=1e-3, batch_size=7)
        assert l2 == 1e-3 and _objective_gradient(layer, x, y, 1e-3).abs().max() < 1e-4
        assert accuracy == float(((x @ layer.weight.T + layer.bias).argmax(-1) == y).float().mean())


def _recording_fits(monkeypatch) -> list[tuple[torch.Tensor, float]]:
    """Record the rows and L2 of every logistic regression that cross_validated_l2 fits."""
    fits, solve = [], head.logistic_regression
    monkeypatch.setattr(head, "logistic_regression",
                        lambda x, y, n, l2, **kw: fits.append((x, l2)) or solve(x, y, n, l2, **kw))
    return fits


def _held_out(x: torch.Tensor, fitted_rows: torch.Tensor) -> torch.Tensor:
    """The mask of x's rows that a fit did not see."""
    return ~(x[:, None] == fitted_rows[None]).all(-1).any(-1)


def test_cross_validation_picks_the_l2_with_the_best_held_out_accuracy(monkeypatch):
    """Noisy labels carried by one of 61 directions, 100 examples: a weak penalty fits noise, a strong one loses the
    signal. The folds must partition the examples into 5 parts of 20, and the choice must be the grid's best
    held-out accuracy, recomputed here from the folds the function used."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100, 61, generator=gen)
    y = ((x[:, 0] + torch.randn(100, generator=gen)) > 0).long()
    grid = (1e-4, 1e-1, 1.0, 1e3)
    solve = head.logistic_regression  # itself checked against its optimality conditions above
    fits = _recording_fits(monkeypatch)
    chosen = head.cross_validated_l2(x, y, 2, grid)
    by_hand = {}
    for l2 in grid:
        held_out = [_held_out(x, rows) for rows, fitted_l2 in fits if fitted_l2 == l2]
        assert [int(mask.sum()) for mask in held_out] == [20] * 5
        assert torch.stack(held_out).sum(0).eq(1).all()  # every example held out exactly once
        hits = 0
        for mask in held_out:
            weight, bias = solve(x[~mask], y[~mask], 2, l2)
            hits += int(((x[mask] @ weight.T + bias).argmax(-1) == y[mask]).sum())
        by_hand[l2] = hits / 100
    best = max(by_hand.values())
    assert list(by_hand.values()).count(best) == 1 and by_hand[1e-1] == best  # an inner grid point wins here
    assert chosen == 1e-1


def test_cross_validation_folds_on_small_sets_and_ties(monkeypatch):
    """16 examples still give 5 folds (sizes 4, 3, 3, 3, 3); a tie goes to the strongest L2; one example cannot be
    cross-validated and gets the strongest."""
    gen = torch.Generator().manual_seed(1)
    y = torch.arange(16) % 2
    x = torch.randn(16, 3, generator=gen) + 6.0 * (2 * y[:, None] - 1)  # separable: every L2 scores 100%
    fits = _recording_fits(monkeypatch)
    assert head.cross_validated_l2(x, y, 2, (1e-3, 1e-2, 1e-1)) == 1e-1
    sizes = sorted(int(_held_out(x, rows).sum()) for rows, l2 in fits if l2 == 1e-3)
    assert sizes == [3, 3, 3, 3, 4]
    assert head.cross_validated_l2(x[:1], y[:1], 2, (1e-3, 1e-1)) == 1e-1


def test_a_run_fits_its_probe_with_the_cross_validated_l2_unless_given(tmp_path, monkeypatch):
    asked, fitted = [], []
    monkeypatch.setattr(head, "cross_validated_l2", lambda x, y, n: asked.append(len(y)) or 0.125)
    solve = head.logistic_regression
    monkeypatch.setattr(head, "logistic_regression", lambda x, y, n, l2: fitted.append(l2) or solve(x, y, n, l2))
    sft.run(_cfg(tmp_path / "auto", max_steps=1))
    sft.run(_cfg(tmp_path / "given", max_steps=1, head_probe_l2=0.25))
    assert asked == [64]  # once, on the 64 training examples, and not when the L2 is given
    assert fitted == [0.125, 0.25]


def _cfg(tmp_path, **overrides) -> Config:
    train_file, eval_file = write_data(tmp_path / "data", n_train=128, n_eval=32)
    values = dict(model_name="tiny-bert", task_name="custom", train_file=str(train_file), eval_file=str(eval_file),
                  template="{text} It was", label_words="terrible,great", num_train=64, trainer="zo", method="lora",
                  learning_rate=1e-3, max_steps=4, per_device_train_batch_size=8, max_length=64, pooling="mean",
                  output_dir=str(tmp_path / "run"), result_file=str(tmp_path / "r.json"), save_strategy="no", seed=0)
    return Config(**{**values, **overrides})


def _final_head(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The head saved beside the adapter in final/ (PEFT's modules_to_save)."""
    saved = load_file(str(Path(cfg.output_dir) / "final" / "adapter_model.safetensors"))
    weight = next(v for k, v in saved.items() if "classifier" in k and k.endswith("weight"))
    bias = next(v for k, v in saved.items() if "classifier" in k and k.endswith("bias"))
    return weight, bias


@pytest.mark.parametrize("head_trainer", ["frozen", "first-order", "zo"])
def test_a_mezo_run_starts_from_the_probe_and_each_head_trainer_does_what_it_says(tmp_path, head_trainer):
    cfg = _cfg(tmp_path, head_trainer=head_trainer, learning_rate=5e-2)
    sft.run(cfg)
    fresh, tok = pretrained.load("tiny-bert", head="classifier", num_labels=2)  # the same weights as the run's
    examples = sample_splits(get_task("custom", cfg.data), cfg.data).train
    x = _features_by_hand(fresh, tok, examples, "mean")
    y = torch.tensor([ex.gold[0] for ex in examples])
    with torch.no_grad():
        fresh.classifier.weight.copy_(_final_head(cfg)[0])
        fresh.classifier.bias.copy_(_final_head(cfg)[1])
    gradient = _objective_gradient(fresh.classifier, x, y, 1e-3).abs().max()
    if head_trainer == "frozen":
        assert gradient < 1e-4  # still the probe: the optimum of the regularised logistic regression
    else:
        assert gradient > 3e-4  # it started there (a random head is far off, see above) and moved


def test_first_order_head_steps_on_the_autograd_gradient_of_detached_features():
    model, tok = pretrained.load("tiny-bert", head="classifier", num_labels=2)
    attach(model, None, r=2)
    named = [(n, p) for n, p in model.named_parameters() if is_head_param(n)]
    for _, p in named:
        p.requires_grad_(True)
    scoring = labels.build_scoring("classifier", tok, WORDS, "mean")
    examples = _examples(12)
    batch = collate_labels(encode_labels(tok, examples, 64, scoring), tok.pad_token_id, scoring)
    model.eval()
    loss = torch.nn.functional.cross_entropy(labels.label_logits(model, batch), batch.labels)
    reference = torch.autograd.grad(loss, model.classifier.weight)[0]  # through the whole forward
    before = model.classifier.weight.detach().clone()
    lr = 1e-3
    trainer = head.HeadTrainer(model, named, lr, TrainingLoss(model).head_loss)
    with torch.no_grad():  # as MeZO's forwards run: on the doubled batch, without autograd
        trainer.train_on(lambda: labels.label_logits(model, batch.doubled()), batch)
    adam_first_step = -lr * reference / (reference.abs() + 1e-8)  # AdamW's first step: lr * m / (sqrt(v) + eps)
    torch.testing.assert_close(model.classifier.weight - before, adam_first_step, rtol=1e-3, atol=1e-7)


def test_only_a_zo_trained_head_keeps_mezo_off_the_dual_batch(tmp_path):
    for head_trainer, dual, in_mezo in (("first-order", True, False), ("frozen", True, False), ("zo", False, True)):
        cfg = _cfg(tmp_path / head_trainer, head_trainer=head_trainer)
        model, _ = pretrained.load("tiny-bert", head="classifier", num_labels=2)
        method = setup_method(model, cfg)
        stepper = build_stepper(cfg, method, TrainingLoss(model), LOCAL, torch.device("cpu"), head=cfg)
        mezo_params = {id(p) for p, _ in stepper.mezo._params}
        assert (stepper.mezo._dual is not None) == dual
        assert (id(model.classifier.weight) in mezo_params) == in_mezo
        assert (stepper.head is not None) == (head_trainer == "first-order")


def test_a_classifier_on_the_users_text_and_labels_needs_no_template_or_label_words(tmp_path):
    """--head classifier with --columns and --label_names trains as the explicit '{text}' prompt with the label
    names as its classes: the same weights and accuracy."""
    import csv

    with open(tmp_path / "reviews.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["review", "sentiment"])
        for i in range(12):
            rows.writerow([("good fine great " if i % 2 else "bad awful poor ") + str(i), "pos" if i % 2 else "neg"])
    common = dict(model_name="tiny-bert", task_name="custom", train_file=str(tmp_path / "reviews.csv"),
                  eval_file=str(tmp_path / "reviews.csv"), head="classifier", columns="text=review,label=sentiment",
                  label_names="neg,pos", method="lora", max_steps=2, device="cpu", save_strategy="no")
    results = {}
    for name, extra in {"bare": {}, "explicit": {"template": "{text}", "label_words": "neg,pos"}}.items():
        results[name] = sft.run(Config(**common, **extra, output_dir=str(tmp_path / name)))
        assert Config(**common, **extra).template == "{text}"
    assert results["bare"]["accuracy"] == results["explicit"]["accuracy"]
    bare, explicit = (load_file(tmp_path / n / "final" / "adapter_model.safetensors") for n in ("bare", "explicit"))
    assert bare.keys() == explicit.keys() and all(torch.equal(bare[k], explicit[k]) for k in bare)
