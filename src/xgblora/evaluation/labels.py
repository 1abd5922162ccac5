"""Label scoring for a fixed label set: a sequence-classification head, or masked-LM prompt scoring (MeZO/LM-BFF).

Both turn an example's prompt into logits over the task's labels (its inputs encoded by data/labels.py), so training
(cross-entropy) and evaluation (arg-max accuracy) are shared. The masked-LM path appends the mask token to the prompt and reads the MLM head's
logits of the one-token label words at that position, as MeZO does for RoBERTa.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from xgblora.data.batches import LabelBatch
from xgblora.data.collation import length_grouped_batches
from xgblora.data.labels import LabelScoring, collate_labels, encode_labels
from xgblora.data.tasks import Example
from xgblora.errors import UserError
from xgblora.models.scoring import POOLINGS, eval_mode, label_logits

HEADS = ("classifier", "mlm")


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


@torch.inference_mode()
def logits_by_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
                    scoring: LabelScoring, *, batch_size: int = 32,
                    max_length: int = 512) -> Iterator[tuple[list[int], LabelBatch, torch.Tensor]]:
    """(example indices, batch, label logits) of length-sorted batches, the model in eval mode."""
    device = next(model.parameters()).device
    seqs = encode_labels(tokenizer, examples, max_length, scoring)
    with eval_mode(model):
        for idx in length_grouped_batches(seqs, batch_size):
            batch = collate_labels([seqs[i] for i in idx], tokenizer.pad_token_id, scoring).to(device)
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
