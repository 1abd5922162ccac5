"""Padded training batches widened to a multiple (the CUDA default): a bounded set of shapes per epoch, and the
same loss and gradients as the unwidened batches."""

import random

import pytest
import torch

from xgblora.adapters import lora
from xgblora.data.collation import TokenSeq, collate, length_grouped_batches, pad_multiple
from xgblora.models import pretrained
from xgblora.train.objective import TrainingLoss, sequence_training_set


def _seqs(n, longest, vocab=500, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, longest)
        target = rng.randint(1, length - 1)
        out.append(TokenSeq(tuple(rng.randrange(3, vocab) for _ in range(length)), target, i, 0))
    return out


def test_an_epoch_meets_at_most_max_length_over_the_multiple_widths():
    seqs = _seqs(400, 300)
    widths = {m: set() for m in (1, 64)}
    for m in widths:
        for idx in length_grouped_batches(seqs, 8, shuffle_seed=0):
            batch = collate([seqs[i] for i in idx], pad_id=0, pad_to_multiple_of=m)
            longest = max(len(seqs[i].ids) for i in idx)
            assert longest <= batch.input_ids.shape[1] < longest + m and batch.input_ids.shape[1] % m == 0
            widths[m].add(batch.input_ids.shape[1])
    assert len(widths[64]) <= -(-300 // 64) < len(widths[1])  # 5 shapes at most, against one per batch or so


def test_pad_multiple_is_for_cuda_only():
    assert pad_multiple(torch.device("cuda")) == 64
    assert pad_multiple(torch.device("cpu")) == 1


@pytest.mark.parametrize("token_mean", [True, False])
def test_widened_batches_give_the_same_loss_and_gradients(token_mean):
    model, _ = pretrained.load("tiny-llama", device="cpu")
    lora.attach(model, "all-linear", r=4)
    for m in model.modules():  # B = 0 would hide a wrong gradient of A
        if isinstance(m, lora.LoRALinear):
            torch.nn.init.normal_(m.lora_B, std=0.02)
    loss_fn = TrainingLoss(model)
    seqs = _seqs(6, 50, vocab=model.config.vocab_size)
    results = []
    for multiple in (1, 64):
        batch = sequence_training_set(seqs, 0, token_mean=token_mean, pad_to_multiple_of=multiple).batch(range(6))
        assert batch.input_ids.shape[1] == (64 if multiple == 64 else max(len(s.ids) for s in seqs))
        model.zero_grad()
        loss = loss_fn(batch).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for _, p in lora.adapter_params(model)]))
    (loss1, grads1), (loss64, grads64) = results
    torch.testing.assert_close(loss64, loss1, atol=1e-6, rtol=1e-6)
    for g64, g1 in zip(grads64, grads1, strict=True):
        torch.testing.assert_close(g64, g1, atol=1e-6, rtol=1e-5)
