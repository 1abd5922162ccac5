"""KTO's loss equals TRL's own code: KTOTrainer._compute_loss, run on a minimal instance whose model returns fixed
per-token log-probabilities (the rows' and the mismatched KL rows'), against `row_losses`, `kl_estimate` and the
logged `KTOStatistics` on the same sums: values, gradients and every metric TRL logs."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from xgblora.preference.kto import KTOObjective, KTOStatistics, kl_estimate, row_losses, totals

trl = pytest.importorskip("trl")
from trl import KTOTrainer  # noqa: E402

ROWS, WIDTH = 6, 7


def fixed_inputs(labels, kl_shift: float, seed: int = 0):
    """Per-token log-probabilities of the rows (a leaf) and of their KL rows [rows, width - 1], the completion masks
    [rows, width] in TRL's layout (a prompt of 2 to 3 tokens, completions of different lengths), the mean logits,
    and the reference's sums (the KL rows' shifted by kl_shift, so the KL estimate is positive or clamped)."""
    g = torch.Generator().manual_seed(seed)
    token_lp = (-torch.rand(ROWS, WIDTH - 1, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    kl_lp = -torch.rand(ROWS, WIDTH - 1, generator=g, dtype=torch.float64) * 2
    mask, kl_mask = (torch.zeros(ROWS, WIDTH, dtype=torch.long) for _ in range(2))
    for row in range(ROWS):
        mask[row, 2 + row % 2:WIDTH - row % 3] = 1
        kl_mask[row, 2 + row % 2:WIDTH - (row + 1) % 3] = 1
    mean_logits = torch.randn(ROWS, WIDTH - 1, generator=g, dtype=torch.float64)
    ref = -torch.rand(ROWS, generator=g, dtype=torch.float64) * 6
    ref_kl = (kl_lp * kl_mask[:, 1:]).sum(1) - kl_shift + torch.randn(ROWS, generator=g, dtype=torch.float64) * 0.1
    return token_lp, kl_lp, mask, kl_mask, mean_logits, ref, ref_kl, torch.tensor(labels)


def trl_kto(inputs, loss_type, beta, desirable_weight, undesirable_weight):
    """TRL's loss, its gradient wrt the rows' token log-probabilities, and its logged metrics."""
    token_lp, kl_lp, mask, kl_mask, mean_logits, ref, ref_kl, labels = inputs
    ids, kl_ids = torch.zeros_like(mask), torch.ones_like(kl_mask)
    main = SimpleNamespace(log_probs=token_lp * mask[:, 1:], entropy=torch.zeros_like(token_lp),
                           mean_logits=mean_logits)

    def model(**kw):
        return SimpleNamespace(log_probs=kl_lp * kl_mask[:, 1:]) if kw["input_ids"] is kl_ids else main

    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
                              precompute_ref_logps=True, calculate_KL=loss_type == "kto", loss_type=loss_type,
                              beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                              _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    trainer._compute_kl_logps = lambda m, batch: KTOTrainer._compute_kl_logps(trainer, m, batch)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(mask), "completion_mask": mask, "label": labels,
             "ref_logps": ref}
    if loss_type == "kto":
        batch.update(KL_input_ids=kl_ids, KL_attention_mask=torch.ones_like(kl_mask), KL_completion_mask=kl_mask,
                     ref_KL_logps=ref_kl)
    loss = KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)
    grad, = torch.autograd.grad(loss, token_lp)
    return loss.detach(), grad, {k: v[0] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}


def ours(inputs, objective: KTOObjective):
    token_lp, kl_lp, mask, kl_mask, mean_logits, ref, ref_kl, labels = inputs
    logps = (token_lp * mask[:, 1:]).sum(1)
    kl_logps = (kl_lp * kl_mask[:, 1:]).sum(1) if objective.estimates_kl else None
    kl = kl_estimate(kl_logps, ref_kl).double().clamp(min=0)
    loss = row_losses(objective, logps - ref, labels, kl).mean()
    grad, = torch.autograd.grad(loss, token_lp)
    statistics = KTOStatistics()
    statistics.add(totals(objective, kl, logps, logps - ref, labels, (mean_logits * mask[:, 1:]).sum(1),
                          mask[:, 1:].sum(1)))
    return loss.detach(), grad, statistics.drain()


MIXED = [True, False, True, True, False, False]


@pytest.mark.parametrize(("labels", "kl_shift"), [(MIXED, 0.8), (MIXED, -0.8), ([True] * ROWS, 0.5),
                                                  ([False] * ROWS, 0.5)])
@pytest.mark.parametrize(("loss_type", "beta", "weights"), [("kto", 0.1, (1.0, 1.0)), ("kto", 0.5, (1.33, 0.7)),
                                                            ("apo_zero_unpaired", 0.3, (1.0, 2.0))])
def test_kto_loss_and_metrics_equal_trl(labels, kl_shift, loss_type, beta, weights):
    """Every label mix (all desirable, all undesirable: TRL logs neither the missing label's means nor the margin),
    a KL estimate above 0 and one clamped to it, both loss types, unequal weights."""
    inputs = fixed_inputs(labels, kl_shift)
    want, want_grad, metrics = trl_kto(inputs, loss_type, beta, *weights)
    got, grad, logged = ours(inputs, KTOObjective(loss_type, beta, *weights))
    assert abs(float(got) - float(want)) < 1e-6
    assert torch.allclose(grad, want_grad, atol=1e-6)
    assert logged.keys() == metrics.keys() - {"entropy"}
    for name, value in logged.items():
        assert value == pytest.approx(metrics[name], abs=1e-6), name
    if loss_type == "kto":
        assert (metrics["kl"] > 0) == (kl_shift > 0)  # both sides of the clamp are tested
