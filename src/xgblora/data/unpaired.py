"""Unpaired preference rows in TRL's KTO formats -> checked `UnpairedExample`s -> tokens -> `PreferenceBatch`es.

The formats of TRL's `KTOTrainer`: `prompt` / `completion` / `label` rows, label true where the completion is
desirable and false where it is not, prompt and completion as strings (standard) or as lists of {"role", "content"}
messages (conversational). A file of preference pairs (`chosen` / `rejected`, data/preference.py) is unpaired as
TRL's `unpair_preference_dataset` does it: in blocks of 1000 pairs (the batch size of the datasets `map` it runs
under), the block's chosen completions (desirable), then its rejected ones. Tokens as TRL's KTOTrainer makes them,
which is how its DPOTrainer makes a pair's.

The KL term's mismatched completions are TRL's: within consecutive blocks of --per_device_train_batch_size rows,
each row takes the completion of the row before it, the first row the block's last. A row whose prompt alone fills
max_length is dropped before the blocks are formed, and prompt + completion and prompt + KL completion are cut to
max_length at the end, as TRL's collator cuts them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from xgblora.data import preference
from xgblora.data.batches import PreferenceBatch
from xgblora.data.preference import PreferenceExample, Text, check_row, check_turns, text_field
from xgblora.data.sources import Where, parse_columns, read_rows
from xgblora.errors import UserError, located

log = logging.getLogger("xgblora")

UNPAIR_BLOCK = 1000  # pairs per block when a preference file is unpaired (datasets' map batch size)


@dataclass(frozen=True)
class UnpairedExample:
    """One checked row: a prompt, a completion (both strings or both message lists), whether the completion is
    desirable, and where the row came from."""

    prompt: Text
    completion: Text
    label: bool
    where: Where


@dataclass(frozen=True)
class UnpairedSeq:
    """A row's tokens: the prompt, the completion, its label and, where the loss estimates the KL term, another
    row's completion, scored after this row's prompt."""

    prompt: list[int]
    completion: list[int]
    label: bool
    kl_completion: list[int] | None = None


def read_unpaired(source: str, columns: str | None = None, split: str = "train") -> list[UnpairedExample]:
    """Every row of a file, folder or dataset id as a checked unpaired row (a preference file's pairs unpaired); a
    bad row is a one-line UserError naming the file, the row and the field."""
    rows = read_rows(source, split, parse_columns(columns))
    first = rows[0][1]
    if "completion" not in first and ("chosen" in first or "rejected" in first):
        return unpair([check_row(where, row) for where, row in rows])
    return [check_unpaired_row(where, row) for where, row in rows]


def check_unpaired_row(where: Where, row: dict) -> UnpairedExample:
    """The row as an unpaired example: prompt, completion and a boolean label present, of one format, a completion
    that is the assistant's reply."""
    def bad(name: str, what: str) -> UserError:
        return located(where[0], where[1], name, what)

    for name in ("prompt", "completion", "label"):
        if row.get(name) is None:
            raise bad(name, f"missing: an unpaired preference row needs prompt, completion and label (true: the "
                            f"completion is desirable, false: it is not); the row has: "
                            f"{', '.join(map(str, row)) or 'no fields'}")
    label = row["label"]
    if not isinstance(label, bool):
        raise bad("label", f"expected true or false (whether the completion is desirable), got {_shown(label)}")
    prompt, completion = (text_field(row[name], bad, name) for name in ("prompt", "completion"))
    if isinstance(prompt, list) != isinstance(completion, list):
        raise bad("completion", "mixes formats: prompt and completion are both strings or both lists of messages")
    if not completion or (isinstance(completion, list) and not any(m["content"] for m in completion)):
        raise bad("completion", "is an empty completion")
    check_turns(prompt, {"completion": completion}, True, bad)
    return UnpairedExample(prompt, completion, label, where)


def _shown(value: object) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def unpair(pairs: Sequence[PreferenceExample]) -> list[UnpairedExample]:
    """TRL's unpair_preference_dataset: per block of UNPAIR_BLOCK pairs, the chosen completions (desirable), then
    the rejected ones."""
    out = []
    for start in range(0, len(pairs), UNPAIR_BLOCK):
        block = pairs[start:start + UNPAIR_BLOCK]
        out += [UnpairedExample(p.prompt, p.chosen, True, p.where) for p in block]
        out += [UnpairedExample(p.prompt, p.rejected, False, p.where) for p in block]
    return out


def encode(tokenizer: PreTrainedTokenizerBase, ex: UnpairedExample) -> UnpairedSeq:
    """The row's tokens, as TRL's KTOTrainer makes them: as a pair's (`preference.encode`) whose two completions are
    this one."""
    seq = preference.encode(tokenizer, PreferenceExample(ex.prompt, ex.completion, ex.completion, ex.where))
    return UnpairedSeq(seq.prompt, seq.chosen, ex.label)


def encode_all(tokenizer: PreTrainedTokenizerBase, examples: Sequence[UnpairedExample], max_length: int,
               kl_block: int | None) -> list[UnpairedSeq]:
    """Every row's tokens, the rows whose prompt fills max_length dropped (and counted); with kl_block, each row's
    KL completion (see the module docstring); every sequence cut to max_length."""
    seqs = [encode(tokenizer, ex) for ex in examples]
    kept = [s for s in seqs if len(s.prompt) < max_length]
    if len(kept) < len(seqs):
        log.warning("%d of %d rows dropped: the prompt alone fills --max_length %s", len(seqs) - len(kept),
                    len(seqs), max_length)
    if not kept:
        raise UserError(f"every row's prompt fills --max_length {max_length}: raise it")
    if kl_block is not None:
        kept = kl_completions(kept, kl_block)
    return [truncate(s, max_length) for s in kept]


def kl_completions(seqs: Sequence[UnpairedSeq], block: int) -> list[UnpairedSeq]:
    """TRL's mismatched pairs: within consecutive blocks of `block` rows, each row takes the completion of the row
    before it (the first row the block's last)."""
    out = []
    for start in range(0, len(seqs), block):
        chunk = seqs[start:start + block]
        out += [dataclasses.replace(s, kl_completion=chunk[i - 1].completion) for i, s in enumerate(chunk)]
    return out


def truncate(seq: UnpairedSeq, max_length: int) -> UnpairedSeq:
    """Prompt + completion and prompt + KL completion cut to max_length at the end (the prompt is shorter)."""
    room = max_length - len(seq.prompt)
    kl = None if seq.kl_completion is None else seq.kl_completion[:room]
    return dataclasses.replace(seq, completion=seq.completion[:room], kl_completion=kl)


def collate_unpaired(seqs: Sequence[UnpairedSeq], pad_id: int, ref_logps: torch.Tensor | None = None) -> PreferenceBatch:
    """The rows as one batch: the completions, then (where the rows have them) the KL completions, and the labels;
    ref_logps [rows, 1 or 2] the reference's sums of both, or None."""
    blocks = [[s.completion for s in seqs]]
    if seqs[0].kl_completion is not None:
        blocks.append([s.kl_completion for s in seqs])
    return preference.collate_completions([s.prompt for s in seqs], blocks, pad_id, ref_logps,
                                          torch.tensor([s.label for s in seqs]))
