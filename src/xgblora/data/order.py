"""The order of training batches: seeded, length-grouped epochs, and an endless stream with a resumable cursor."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int,
                  group_by_length: bool = True) -> list[list[int]]:
    """One epoch's batches of example indices: a seeded shuffle, then (HF-style) length grouping within mega-batches.

    The order depends only on (seed, epoch), so a resumed run sees the same batches as an uninterrupted one.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    if group_by_length:
        mega = batch_size * 50
        order = [i for k in range(0, len(order), mega)
                 for i in sorted(order[k:k + mega], key=lambda i: -lengths[i])]
    batches = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    if group_by_length and len(batches) > 1:  # length-sorted mega-batches would put the longest batches first
        perm = torch.randperm(len(batches), generator=gen).tolist()
        batches = [batches[p] for p in perm]
    return batches


@dataclass
class BatchStream:
    """Endless training batches of example indices; (epoch, cursor) is all a resumed run needs to continue exactly."""

    lengths: list[int]
    batch_size: int
    seed: int
    group_by_length: bool
    epoch: int = 0
    cursor: int = 0

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batches = epoch_batches(self.lengths, self.batch_size, self.seed, self.epoch, self.group_by_length)
            while self.cursor < len(batches):
                self.cursor += 1
                yield batches[self.cursor - 1]
            self.epoch, self.cursor = self.epoch + 1, 0
