"""Gradient caching (GradCache, Gao et al. 2021): the embeddings of a large contrastive batch at the memory of one
mini-batch.

`cached_embed(embed_fn, ids, mask, size=m)` returns the embeddings [N, H] of all N rows as one autograd node:

- forward: embeds the rows m at a time without a graph (activations of one mini-batch alive at a time);
- backward: handed the gradient of the loss with respect to every embedding (the loss over the whole batch, so
  every row is a negative of every query), re-embeds each mini-batch with a graph, its RNG state restored so that
  dropout draws the same masks as in the forward, and back-propagates that mini-batch's slice of the gradient into
  the parameters.

The loss and the parameter gradients equal those of the batch embedded in one piece (without dropout; with
dropout, those of the same mini-batches embedded with a graph; with LoRA on a half-precision base, up to the
rounding of the adapter branch, which runs in fp32 without a graph and in the base's dtype with one). Under
no_grad (MeZO's forwards, evaluation) it is a chunked forward. Rows of like length share a mini-batch, each cut
to its longest row (right padding): sentence-transformers' cached loss cuts the batch in order, so on rows of
mixed length it runs many padding tokens more.

MeZO's dual batch (halves=2: rows [:n] at +eps z, rows [n:] at -eps z, told apart by position) is cut in aligned
pieces, the same rows of both halves together, so that every mini-batch is a dual batch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from xgblora.embeddings.pieces import EmbedFn, aligned, longest_first, trim


def mini_batches(n_rows: int, size: int, halves: int = 1, lengths: Tensor | None = None) -> list[Tensor]:
    """Row indices of each mini-batch: `size` rows of every half, aligned across halves. Given the rows' `lengths`,
    longest first, so that rows of like length share a mini-batch and each is cut to little padding; the loss does
    not depend on how the rows are grouped."""
    order = longest_first(lengths, halves) if lengths is not None else torch.arange(n_rows // halves)
    return aligned(order, [(start, start + size) for start in range(0, len(order), size)], halves)


class _RngState:
    """The CPU and (on CUDA) the device RNG state before a mini-batch's forward, to replay its dropout."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _CachedEmbeddings(torch.autograd.Function):
    """Embeddings computed without a graph; backward recomputes each mini-batch with one and back-propagates."""

    @staticmethod
    def forward(ctx, embed_fn: EmbedFn, ids: Tensor, mask: Tensor, pieces: Sequence[Tensor],
                _anchor: Tensor) -> Tensor:
        device = ids.device
        ctx.embed_fn, ctx.ids, ctx.mask, ctx.pieces = embed_fn, ids, mask, pieces
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        ctx.states = []
        out: Tensor | None = None
        for rows in pieces:
            ctx.states.append(_RngState(device))
            vectors = embed_fn(*trim(ids, mask, rows))
            if out is None:
                out = vectors.new_empty((ids.shape[0], vectors.shape[1]))
            out[rows.to(device)] = vectors
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, ...]:
        device = ctx.ids.device
        enabled, dtype = ctx.autocast
        cuda = [device] if device.type == "cuda" else []
        for rows, state in zip(ctx.pieces, ctx.states, strict=True):
            with torch.random.fork_rng(devices=cuda), torch.enable_grad(), \
                    torch.autocast(device.type, dtype=dtype, enabled=enabled):
                state.restore()
                vectors = ctx.embed_fn(*trim(ctx.ids, ctx.mask, rows))
                torch.autograd.backward(vectors, grad[rows.to(device)])
        return None, None, None, None, None


def cached_embed(embed_fn: EmbedFn, ids: Tensor, mask: Tensor, size: int, halves: int = 1) -> Tensor:
    """Embeddings [N, H] of right-padded rows, `size` rows of each half at a time; gradients by recomputation."""
    anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())  # makes autograd call backward
    pieces = mini_batches(ids.shape[0], size, halves, lengths=mask.sum(1))
    return _CachedEmbeddings.apply(embed_fn, ids, mask, pieces, anchor)
