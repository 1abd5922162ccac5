"""Evaluation of instruction data: loss and perplexity over the answer tokens, greedy generations stopped at EOS or
the end of the turn, and their exact match / F1 against the references (GSM8K's `#### N` compared as numbers)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from xgblora.data import formats
from xgblora.data.collation import iter_batches
from xgblora.data.tasks import Example
from xgblora.evaluation.answers import f1_score, normalize_answer
from xgblora.models.sampler import greedy_continuations
from xgblora.models.scoring import eval_mode, target_logprobs

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The answer of a GSM8K-style solution: the first number after the last '####', else the text's last number."""
    numbers = _NUMBER.findall(text.rsplit("####", 1)[1])[:1] if "####" in text else _NUMBER.findall(text)[-1:]
    return float(numbers[0].replace(",", "")) if numbers else None


@torch.inference_mode()
def token_loss(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *,
               max_length: int, batch_size: int, train_on_prompt: bool = False,
               stop_ids: Sequence[int] = ()) -> float:
    """Mean negative log-likelihood over the target tokens of every example (the training targets and mask)."""
    seqs = formats.instruction_seqs(tokenizer, examples, max_length, train_on_prompt, stop_ids)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with eval_mode(model):
        for _, batch in iter_batches(seqs, batch_size, tokenizer.pad_token_id, device):
            total -= float(target_logprobs(model, batch).double().sum())
            count += int(batch.target_mask.sum())
    return total / count


def evaluate_instructions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
                          *, stop_ids: Sequence[int], batch_size: int = 8, max_length: int = 2048,
                          max_new_tokens: int = 256, train_on_prompt: bool = False
                          ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics of instruction examples and one prediction record per generated example.

    Metrics: `loss` (first: the best checkpoint has the lowest) and `perplexity`; for examples with a prompt to
    answer (not plain-text rows) `em` and `f1` against the reference, and `accuracy` when every reference ends in
    GSM8K's `#### N` (the final numbers compared, to 1e-6).
    """
    loss = token_loss(model, tokenizer, examples, max_length=max_length, batch_size=batch_size,
                      train_on_prompt=train_on_prompt, stop_ids=stop_ids)
    metrics: dict[str, float] = {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
    answerable = [ex for ex in examples if ex.prompt or ex.messages]
    if not answerable:
        return metrics, []
    texts = [formats.prompt_text(tokenizer, ex) for ex in answerable]
    prompts = [formats.prompt_ids(tokenizer, text, bool(ex.messages)) for text, ex in zip(texts, answerable, strict=True)]
    predictions = [text.strip() for text in greedy_continuations(model, tokenizer, prompts, stop_ids, batch_size=batch_size,
                                                     max_length=max_length, max_new_tokens=max_new_tokens)]
    references = [ex.answers[0] for ex in answerable]
    metrics["em"] = _mean([normalize_answer(p) == normalize_answer(r) for p, r in zip(predictions, references, strict=True)])
    metrics["f1"] = _mean([f1_score(p, r) for p, r in zip(predictions, references, strict=True)])
    if all("####" in r for r in references):
        metrics["accuracy"] = _mean([_same_number(p, r) for p, r in zip(predictions, references, strict=True)])
    records = [{"prompt": t, "prediction": p, "reference": r} for t, p, r in zip(texts, predictions, references, strict=True)]
    return metrics, records


def _same_number(prediction: str, reference: str) -> bool:
    got, want = final_number(prediction), final_number(reference)
    return got is not None and want is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))


def _mean(values: Sequence[float | bool]) -> float:
    return sum(values) / len(values)
