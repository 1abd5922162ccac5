"""Label scoring for a fixed label set: a sequence-classification head, or masked-LM prompt scoring (MeZO/LM-BFF).

Both turn an example's prompt into logits over the task's labels, so training (cross-entropy) and evaluation
(arg-max accuracy) are shared. The masked-LM path appends the mask token to the prompt and reads the MLM head's
logits of the one-token label words at that position, as MeZO does for RoBERTa.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from xgblora.data.batches import LabelBatch
from xgblora.data.collation import length_grouped_batches
from xgblora.data.tasks import Example
from xgblora.errors import UserError
from xgblora.models.scoring import POOLINGS, eval_mode, label_logits

HEADS = ("classifier", "mlm")
CLASSIFIER_MODULES = ("classifier", "score", "pre_classifier")  # PEFT's names for SEQ_CLS heads, plus DistilBERT's


def is_head_param(name: str) -> bool:
    """Whether a parameter belongs to a new classification head (trained in every method, saved beside adapters)."""
    return name.split(".")[0] in CLASSIFIER_MODULES


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


def build_scoring(kind: str, tokenizer: PreTrainedTokenizerBase, words: Sequence[str],
                  pooling: str = "cls") -> LabelScoring:
    """LabelScoring for `kind`; for mlm every label word must be one token of this tokenizer."""
    if kind == "classifier":
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}: choose one of {POOLINGS}")
        return LabelScoring(kind, tuple(words), pooling=pooling)
    if kind != "mlm":
        raise ValueError(f"unknown label scoring {kind!r}: choose one of {HEADS}")
    if tokenizer.mask_token_id is None:
        raise UserError("--head mlm needs a tokenizer with a mask token; this one has none (use --head classifier)")
    ids = []
    for word in words:
        pieces = tokenizer.encode(word, add_special_tokens=False)
        if len(pieces) != 1:
            raise UserError(f"--head mlm scores one-token label words; {word!r} is {len(pieces)} tokens "
                            f"({tokenizer.convert_ids_to_tokens(pieces)}) for this tokenizer (use --head classifier)")
        ids.append(pieces[0])
    return LabelScoring(kind, tuple(words), tuple(ids))


def encode(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
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


def collate(seqs: Sequence[LabelSeq], pad_id: int, scoring: LabelScoring) -> LabelBatch:
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


@torch.inference_mode()
def logits_by_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
                    scoring: LabelScoring, *, batch_size: int = 32,
                    max_length: int = 512) -> Iterator[tuple[list[int], LabelBatch, torch.Tensor]]:
    """(example indices, batch, label logits) of length-sorted batches, the model in eval mode."""
    device = next(model.parameters()).device
    seqs = encode(tokenizer, examples, max_length, scoring)
    with eval_mode(model):
        for idx in length_grouped_batches(seqs, batch_size):
            batch = collate([seqs[i] for i in idx], tokenizer.pad_token_id, scoring).to(device)
            yield idx, batch, label_logits(model, batch)


def predict(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
            scoring: LabelScoring, *, batch_size: int = 32, max_length: int = 512) -> list[list[float]]:
    """Label logits of every example, in length-sorted batches."""
    scores: list[list[float]] = [[] for _ in examples]
    for idx, _, logits in logits_by_batch(model, tokenizer, examples, scoring, batch_size=batch_size,
                                          max_length=max_length):
        for i, row in zip(idx, logits.tolist(), strict=True):
            scores[i] = row
    return scores


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
             scoring: LabelScoring, *, batch_size: int = 32, max_length: int = 512) -> dict[str, Any]:
    """{"accuracy": ..., "predicted_shares": [...]}: the arg-max label against each example's gold labels, and the
    share of the examples predicted as each label (a head collapsed onto one class shows as 0 and 1)."""
    if not examples:
        return {}
    scores = predict(model, tokenizer, examples, scoring, batch_size=batch_size, max_length=max_length)
    predicted = [max(range(len(s)), key=s.__getitem__) for s in scores]
    correct = [p in ex.gold for p, ex in zip(predicted, examples, strict=True)]
    shares = [predicted.count(k) / len(predicted) for k in range(len(scoring.label_words))]
    return {"accuracy": sum(correct) / len(correct), "predicted_shares": shares}
