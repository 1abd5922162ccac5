"""Evaluation of instruction data: loss and perplexity over the answer tokens, greedy generations stopped at EOS or
the end of the turn, and their exact match / F1 against the references (GSM8K's `#### N` graded by RFT's verifier:
`answers.gsm8k_answer`, the first number after the first `####`; a prediction without one is wrong)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from xgblora.data import formats
from xgblora.data.collation import iter_batches
from xgblora.data.tasks import Example
from xgblora.evaluation.answers import MathVerifier, Verifier, f1_score, gsm8k_answer, normalize_answer
from xgblora.models.sampler import greedy_continuations
from xgblora.models.scoring import eval_mode, target_logprobs

GSM8K = Verifier(gsm8k_answer)


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
    GSM8K's `#### N` (graded as RFT grades it: `GSM8K.judge`), or a LaTeX `\\boxed{}` answer (the math verifier).
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
    verifier = answer_verifier(references)
    if verifier is not None:
        metrics["accuracy"] = _mean([verifier.judge([p], r)[0] for p, r in zip(predictions, references, strict=True)])
    records = [{"prompt": t, "prediction": p, "reference": r} for t, p, r in zip(texts, predictions, references, strict=True)]
    return metrics, records


def answer_verifier(references: Sequence[str]) -> Verifier | MathVerifier | None:
    """How accuracy is graded, when every reference says: GSM8K's `#### N`, or a LaTeX `\\boxed{}` answer
    (math-verify's judgement, when the package is installed); None otherwise."""
    if all("####" in r for r in references):
        return GSM8K
    if all("\\boxed{" in r for r in references) and importlib.util.find_spec("math_verify") is not None:
        return MathVerifier()
    return None


def _mean(values: Sequence[float | bool]) -> float:
    return sum(values) / len(values)
