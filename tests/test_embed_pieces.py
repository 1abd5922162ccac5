"""Plain contrastive batches embedded in length-sorted pieces (`--embed_pieces`): the cuts are the least-cost ones
(every partition of the sorted rows tried is the reference), and the loss and parameter gradients equal those of
the batch in one piece (autograd of the one-piece loss is the reference), for contrastive training, GRIT's
embedding half and MeZO's dual batch."""

import itertools

import pytest
import torch
from helpers import (
    assert_same,
    dual_batch_losses,
    grit_batch,
    grit_loss_and_grads,
    loss_and_grads,
    pair_batch,
    run_losses,
)

from xgblora.config import Config
from xgblora.embeddings import pieces as pieces_module
from xgblora.embeddings.contrastive import Contrastive
from xgblora.embeddings.pieces import embed_in_pieces, length_pieces, split_cost
from xgblora.models import pretrained


def least_cost(widths: list[int], cost: float) -> float:
    """Every way to cut rows sorted longest first into consecutive pieces, the cheapest."""
    n, best = len(widths), float("inf")
    for cuts in itertools.product((False, True), repeat=n - 1):
        starts = [0] + [i + 1 for i, cut in enumerate(cuts) if cut]
        best = min(best, sum((end - start) * widths[start] + cost
                             for start, end in zip(starts, [*starts[1:], n], strict=True)))
    return best


def pieces_cost(pieces: list[torch.Tensor], lengths: torch.Tensor, cost: float) -> float:
    return sum(len(rows) * int(lengths[rows].max()) + cost for rows in pieces)


@pytest.mark.parametrize("cost", [0.0, 8.0, 32.0, 1000.0])
def test_pieces_are_the_least_cost_cuts_and_cover_every_row_once(cost):
    lengths = torch.tensor([5, 40, 7, 33, 12, 40, 3, 21, 9])
    pieces = length_pieces(lengths, cost)
    assert sorted(torch.cat(pieces).tolist()) == list(range(9))
    assert pieces_cost(pieces, lengths, cost) == pytest.approx(least_cost(sorted(lengths.tolist())[::-1], cost))
    if cost >= 1000:
        assert len(pieces) == 1  # a forward costs more than all the padding


def test_pieces_of_a_dual_batch_hold_the_same_rows_of_both_halves():
    lengths = torch.tensor([5, 40, 7, 33, 5, 40, 7, 33])  # rows [:4] at +eps z, rows [4:] at -eps z
    pieces = length_pieces(lengths, 0.0, halves=2)
    assert [p.tolist() for p in pieces] == [[1, 5], [3, 7], [2, 6], [0, 4]]


def test_rows_come_back_in_their_places_each_piece_at_its_own_width():
    lengths = torch.tensor([2, 8, 2, 8, 3])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    ids = (torch.arange(8)[None, :] + 1) * mask
    widths = []

    def embed_fn(rows_ids, rows_mask):
        widths.append(rows_ids.shape[1])
        return rows_ids.float().sum(1, keepdim=True)

    out = embed_in_pieces(embed_fn, ids, mask, length_pieces(lengths, 3.0))
    assert sorted(widths) == [3, 8]  # the 2-token rows share the 3-token row's piece: a forward costs more
    torch.testing.assert_close(out, ids.float().sum(1, keepdim=True))


@pytest.mark.parametrize("cost", [0.0, 4.0])
def test_contrastive_loss_and_gradients_in_pieces_equal_the_batch_in_one_piece(cost):
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    model.eval()  # no dropout: both compute the same function
    batch = pair_batch(tokenizer, negatives=2)
    assert len(length_pieces(batch.doc_mask.sum(1), cost)) > 1  # not vacuous: the batch is cut
    params = list(model.parameters())
    plain = Contrastive("mean", 0.05, learnable=True)
    pieces = Contrastive("mean", 0.05, learnable=True, split_cost=cost)
    assert_same(loss_and_grads(model, batch, plain, [*params, plain.log_scale]),
                loss_and_grads(model, batch, pieces, [*params, pieces.log_scale]))


def test_grit_in_pieces_equals_grit_in_one_piece(tmp_path):
    """GRIT's embedding half in pieces (a tiny Llama embedding both ways), beside its generative half."""
    model, tokenizer = pretrained.load("tiny-llama")
    model.eval()
    batch = grit_batch(tokenizer, tmp_path)
    assert len(length_pieces(batch.pairs.doc_mask.sum(1), 0.0)) > 1
    assert_same(grit_loss_and_grads(model, batch, Contrastive("mean", 0.05, bidirectional=True)),
                grit_loss_and_grads(model, batch, Contrastive("mean", 0.05, bidirectional=True, split_cost=0.0)))


def test_mezo_dual_batch_in_pieces_gives_the_losses_of_the_whole_batch():
    """Under MeZO the pieces are forwards without a graph, each a dual batch: L+ and L- equal the one piece's."""
    found = dual_batch_losses([Contrastive("mean", 0.05), Contrastive("mean", 0.05, split_cost=0.0)])
    assert found[1] == pytest.approx(found[0], rel=1e-5) and found[0][0] != found[0][1]


def test_pieces_are_on_by_default_on_the_cpu_only_and_can_be_turned_off():
    assert Config(objective="contrastive", train_file="pairs.jsonl").embed_pieces is None
    assert split_cost(None, torch.device("cpu")) is not None
    assert split_cost(None, torch.device("cuda")) is None
    assert split_cost(False, torch.device("cpu")) is None
    assert split_cost(True, torch.device("cuda")) is not None


def test_a_run_in_pieces_trains_like_the_run_in_one_piece(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces_module, "SPLIT_COST_TOKENS", 0.0)  # every length its own piece: the tiny rows are cut
    one_piece = run_losses(tmp_path, monkeypatch, "one-piece", embed_pieces=False)
    in_pieces = run_losses(tmp_path, monkeypatch, "pieces", embed_pieces=True)
    assert len(one_piece) == 4 and in_pieces == pytest.approx(one_piece, rel=1e-5)
    assert one_piece[0] != one_piece[-1]
