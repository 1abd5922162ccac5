"""A fixed label set's examples as model inputs: the label words of a task, each prompt tokenised (with the mask token
for masked-LM scoring) and its gold label, collated into LabelBatches; what training and evaluation of a classifier
or masked-LM head read (evaluation/labels.py scores them)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from xgblora.data.batches import LabelBatch
from xgblora.data.tasks import Example
from xgblora.errors import UserError


@dataclass(frozen=True)
class LabelScoring:
    """How labels are scored: kind ('classifier' | 'mlm'), the label words, (mlm) their token ids, and
    (classifier) what the head reads (`scoring.POOLINGS`)."""

    kind: str
    label_words: tuple[str, ...]
    label_token_ids: tuple[int, ...] = ()
    pooling: str = "cls"


@dataclass(frozen=True)
class LabelSeq:
    """One tokenised input, its gold label index, and (mlm) the position of its mask token."""

    ids: tuple[int, ...]
    label: int
    mask_pos: int = -1


def label_words(task_name: str, *example_sets: Sequence[Example]) -> tuple[str, ...]:
    """The task's fixed label set (its candidates); UserError when candidates differ between examples."""
    found: tuple[str, ...] | None = None
    for ex in (ex for examples in example_sets for ex in examples):
        if not ex.candidates:
            raise UserError(f"{task_name} is a generation task: a classification or masked-LM head needs answer "
                            f"candidates; use a causal LM (--head lm)")
        if found is None:
            found = ex.candidates
        elif ex.candidates != found:
            raise UserError(f"{task_name} has per-example answer candidates ({found!r} vs {ex.candidates!r}); a "
                            f"classification or masked-LM head needs one fixed label set; use a causal LM (--head lm)")
    if found is None:
        raise UserError(f"{task_name}: no examples to take the label set from")
    return found


def encode_labels(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
           scoring: LabelScoring) -> list[LabelSeq]:
    """Tokenise each example's prompt (mlm: followed by the mask token) in one tokenizer call.

    Inputs longer than max_length lose tokens from the left, after a leading [CLS]/<s>, so the end of the prompt
    (the cue and the mask) is kept; one warning gives the count.
    """
    texts = [ex.prompt.rstrip() + " " + tokenizer.mask_token if scoring.kind == "mlm" else ex.prompt
             for ex in examples]
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
    head = [tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id]
    out, truncated = [], 0
    for ex, ids in zip(examples, encoded, strict=True):
        if len(ids) > max_length:
            truncated += 1
            keep = 1 if ids[:1] == head else 0
            ids = ids[:keep] + ids[len(ids) - (max_length - keep):]
        mask_pos = len(ids) - 1 - ids[::-1].index(tokenizer.mask_token_id) if scoring.kind == "mlm" else -1
        out.append(LabelSeq(tuple(ids), ex.gold[0] if ex.gold else -1, mask_pos))
    if truncated:
        warnings.warn(f"{truncated} of {len(out)} inputs were longer than max_length={max_length} tokens and were "
                      f"truncated from the left (the end of the prompt is kept)", stacklevel=2)
    return out


def collate_labels(seqs: Sequence[LabelSeq], pad_id: int, scoring: LabelScoring) -> LabelBatch:
    """Right-padded input_ids and attention_mask, the labels, and (mlm) mask positions and label token ids per row."""
    rows = [torch.tensor(s.ids) for s in seqs]
    input_ids = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id)
    lengths = torch.tensor([len(s.ids) for s in seqs])
    mlm = scoring.kind == "mlm"
    return LabelBatch(input_ids=input_ids, attention_mask=(torch.arange(input_ids.shape[1]) < lengths[:, None]).long(),
                      labels=torch.tensor([s.label for s in seqs]),
                      mask_pos=torch.tensor([s.mask_pos for s in seqs]) if mlm else None,
                      label_token_ids=torch.tensor([scoring.label_token_ids] * len(seqs)) if mlm else None,
                      pooling=scoring.pooling)
