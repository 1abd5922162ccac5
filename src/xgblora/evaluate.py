"""Evaluation as MeZO does it: candidate scoring by log-probability (optionally SFC-calibrated), greedy generation + F1/EM."""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from xgblora.data.batching import demonstration_text, encode_pairs, iter_batches, target_logprobs
from xgblora.data.tasks import Example, Task


@torch.inference_mode()
def _sum_logprobs(model: PreTrainedModel, seqs, batch_size: int, pad_id: int,
                  side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed target log-probability and target length of every sequence, in input order."""
    device = next(model.parameters()).device
    sums = torch.zeros(len(seqs), dtype=torch.float64)
    counts = torch.zeros(len(seqs), dtype=torch.float64)
    for idx, batch in iter_batches(seqs, batch_size, pad_id, device, side):
        logprobs = target_logprobs(model, batch)
        sums[idx] = logprobs.sum(-1).double().cpu()
        counts[idx] = batch["target_mask"].sum(-1).double().cpu()
    return sums, counts


def candidate_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *,
                     demos: Sequence[Example] = (), sfc: bool = False, icl_sfc: bool = False, batch_size: int = 8,
                     max_length: int = 2048, padding_side: str = "left") -> list[list[float]]:
    """Score every candidate of every example in length-sorted batches over all (example, candidate) pairs.

    The score is the mean log-probability of the candidate's tokens after the prompt (MeZO), or with SFC the
    summed log-probability minus that under the example's calibration prompt (surface-form competition).
    """
    was_training = model.training
    model.eval()
    prefix = demonstration_text(demos)
    seqs = encode_pairs(tokenizer, examples, max_length, prefix=prefix)
    sums, counts = _sum_logprobs(model, seqs, batch_size, tokenizer.pad_token_id, padding_side)
    if sfc or icl_sfc:
        calib = encode_pairs(tokenizer, examples, max_length, prefix=prefix if icl_sfc else "",
                             prompts=[ex.sfc_prompt for ex in examples])
        calib_sums, _ = _sum_logprobs(model, calib, batch_size, tokenizer.pad_token_id, padding_side)
        values = sums - calib_sums
    else:
        values = sums / counts
    model.train(was_training)
    scores: list[list[float]] = [[0.0] * len(ex.candidates) for ex in examples]
    for seq, value in zip(seqs, values.tolist(), strict=True):
        scores[seq.example][seq.candidate] = value
    return scores


@torch.inference_mode()
def generate_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *,
                     demos: Sequence[Example] = (), batch_size: int = 8, max_length: int = 2048,
                     max_new_tokens: int = 50) -> list[str]:
    """Greedy answers, batched with left padding, stopped at a newline or end of sequence."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prefix = demonstration_text(demos)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1:]
    stop = [t for t in [tokenizer.eos_token_id, *newline] if t is not None]
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].prompt))
    answers = [""] * len(examples)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = tokenizer([prefix + examples[i].prompt for i in idx], return_tensors="pt", padding=True,
                        truncation=True, max_length=max(1, max_length - max_new_tokens)).to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                             eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, text in zip(idx, texts, strict=True):
            answers[i] = text.strip().split("\n")[0].strip()
    model.train(was_training)
    return answers


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """Token-overlap F1 between a prediction and one reference (SQuAD's definition)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, examples: Sequence[Example], *,
             demos: Sequence[Example] = (), sfc: bool = False, icl_sfc: bool = False, batch_size: int = 8,
             max_length: int = 2048, max_new_tokens: int = 50) -> dict[str, float]:
    """Task metric on examples: {"accuracy": ...} for candidate tasks, {"f1": ..., "em": ...} for generation."""
    if not examples:
        return {}
    if task.generation:
        preds = generate_answers(model, tokenizer, examples, demos=demos, batch_size=batch_size,
                                 max_length=max_length, max_new_tokens=max_new_tokens)
        f1 = [max(f1_score(p, a) for a in ex.answers) for p, ex in zip(preds, examples, strict=True)]
        em = [max(float(normalize_answer(p) == normalize_answer(a)) for a in ex.answers)
              for p, ex in zip(preds, examples, strict=True)]
        return {"f1": sum(f1) / len(f1), "em": sum(em) / len(em)}
    scores = candidate_scores(model, tokenizer, examples, demos=demos, sfc=sfc, icl_sfc=icl_sfc,
                              batch_size=batch_size, max_length=max_length)
    correct = [max(range(len(s)), key=s.__getitem__) in ex.gold for s, ex in zip(scores, examples, strict=True)]
    return {"accuracy": sum(correct) / len(correct)}
