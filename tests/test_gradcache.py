"""Gradient caching (`--mini_batch_size`): the contrastive loss of a batch embedded a few rows at a time equals the
loss of the batch in one piece, and so do the parameter gradients (autograd of the plain loss is the reference),
for contrastive training, GRIT's embedding half and MeZO's dual batch; with dropout, the recomputed mini-batches
draw the masks of the forward."""


import pytest
import torch
from helpers import (
    assert_same,
    dual_batch_losses,
    grads,
    grit_batch,
    grit_loss_and_grads,
    loss_and_grads,
    pair_batch,
    run_losses,
)

from xgblora.config import Config
from xgblora.embeddings.contrastive import Contrastive, info_nce
from xgblora.embeddings.gradcache import cached_embed, mini_batches
from xgblora.embeddings.pooling import embed
from xgblora.errors import UserError
from xgblora.models import pretrained


def test_mini_batches_cover_every_row_once_and_align_the_halves_of_a_dual_batch():
    assert [p.tolist() for p in mini_batches(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [p.tolist() for p in mini_batches(10, 2, halves=2)] == [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9]]


def test_mini_batches_group_rows_of_like_length_longest_first_in_both_halves():
    lengths = torch.tensor([3, 9, 1, 9, 5, 2, 3, 9, 1, 9, 5, 2])  # a dual batch: the same 6 rows twice
    assert [p.tolist() for p in mini_batches(6, 2, lengths=lengths[:6])] == [[1, 3], [4, 0], [5, 2]]
    assert [p.tolist() for p in mini_batches(12, 2, halves=2, lengths=lengths)] == [[1, 3, 7, 9], [4, 0, 10, 6],
                                                                                    [5, 2, 11, 8]]


def test_cached_embedding_runs_fewer_padding_tokens_than_mini_batches_cut_in_order():
    """Four short and four long rows interleaved: in order every mini-batch of 2 is as wide as the longest row."""
    lengths = torch.tensor([2, 8, 2, 8, 2, 8, 2, 8])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    ids = torch.arange(8)[None, :].expand(8, 8) * mask
    widths = []

    def embed_fn(rows_ids, rows_mask):
        widths.append(rows_ids.shape[1])
        return rows_ids.float().sum(1, keepdim=True)

    out = cached_embed(embed_fn, ids, mask, size=2)
    assert sorted(widths) == [2, 2, 8, 8]  # in order: [8, 8, 8, 8]
    torch.testing.assert_close(out, ids.float().sum(1, keepdim=True))  # each row back in its place


@pytest.mark.parametrize("mini_batch", [1, 3, 4])
def test_cached_contrastive_loss_and_gradients_equal_the_batch_in_one_piece(mini_batch):
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    model.eval()  # no dropout: the one-piece batch and the mini-batches compute the same function
    batch = pair_batch(tokenizer, negatives=2)
    params = list(model.parameters())
    plain = Contrastive("mean", 0.05, learnable=True)
    cached = Contrastive("mean", 0.05, learnable=True, mini_batch=mini_batch)
    assert_same(loss_and_grads(model, batch, plain, [*params, plain.log_scale]),
                loss_and_grads(model, batch, cached, [*params, cached.log_scale]))


def test_with_dropout_each_recomputed_mini_batch_draws_the_masks_of_its_forward():
    """Reference: the same mini-batches embedded with a graph, in the same order, from the same RNG state."""
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    model.train()
    batch = pair_batch(tokenizer)
    params = list(model.parameters())
    objective = Contrastive("mean", 0.05, mini_batch=3)

    def chunked(ids, mask):
        pieces, order = [], []
        for rows in mini_batches(ids.shape[0], 3, lengths=mask.sum(1)):
            width = int(mask[rows].sum(1).max())  # each mini-batch cut to its longest row
            pieces.append(embed(model, ids[rows, :width], mask[rows, :width], "mean"))
            order.append(rows)
        return torch.cat(pieces)[torch.cat(order).argsort()]  # each row back in its place

    torch.manual_seed(5)
    q, d = chunked(batch.query_ids, batch.query_mask), chunked(batch.doc_ids, batch.doc_mask)
    reference = info_nce(q, d, batch.positive, batch.doc_key, 20.0).mean()
    reference.backward()
    expected = (float(reference.detach()), grads(params))
    torch.manual_seed(5)
    got = loss_and_grads(model, batch, objective, params)
    assert_same(expected, got)
    torch.manual_seed(6)  # other masks: another loss, so the comparison above is not vacuous
    assert loss_and_grads(model, batch, objective, params)[0] != pytest.approx(expected[0], rel=1e-6)


def test_cached_grit_equals_grit_in_one_piece(tmp_path):
    """GRIT's embedding half cached (a tiny Llama embedding bidirectionally) beside its generative half."""
    model, tokenizer = pretrained.load("tiny-llama")
    model.eval()
    batch = grit_batch(tokenizer, tmp_path)
    weights = (1.0, 0.5)
    assert_same(grit_loss_and_grads(model, batch, Contrastive("last", 0.05, bidirectional=True, weights=weights)),
                grit_loss_and_grads(model, batch, Contrastive("last", 0.05, bidirectional=True, weights=weights,
                                                              mini_batch=3)))


def test_mezo_dual_batch_in_mini_batches_gives_the_losses_of_the_whole_batch():
    """Under MeZO the cached path is two chunked forwards: L+ and L- equal the one-piece dual batch's."""
    found = dual_batch_losses([Contrastive("mean", 0.05), Contrastive("mean", 0.05, mini_batch=3)])
    assert found[1] == pytest.approx(found[0], rel=1e-5) and found[0][0] != found[0][1]


def test_a_run_with_mini_batches_trains_like_the_run_in_one_piece(tmp_path, monkeypatch):
    plain = run_losses(tmp_path, monkeypatch, "plain", mini_batch_size=0, embed_pieces=False)
    cached = run_losses(tmp_path, monkeypatch, "cached", mini_batch_size=2)
    assert len(plain) == 4 and cached == pytest.approx(plain, rel=1e-5)
    assert plain[0] != plain[-1]


def test_mini_batch_size_is_refused_where_it_cannot_apply():
    with pytest.raises(UserError, match="--mini_batch_size"):
        Config(task_name="SST2", mini_batch_size=4)
    with pytest.raises(UserError, match="--mini_batch_size"):
        Config(objective="contrastive", train_file="pairs.jsonl", mini_batch_size=-1)
