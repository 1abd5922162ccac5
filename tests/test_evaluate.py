"""Candidate scoring and generation against unbatched, hand-written references on both tiny families."""

import pytest
import torch

from xgblora import models
from xgblora.data.batching import collate, encode_pairs
from xgblora.data.tasks import Example
from xgblora.evaluate import candidate_scores, evaluate, f1_score, generate_answers, normalize_answer

EXAMPLES = [
    Example("the movie was long and dull. It was", (" terrible", " great"), (0,), sfc_prompt=" It was"),
    Example("fun!", (" terrible", " great", " not good at all"), (1,), sfc_prompt=" It was"),
    Example("Does this mean that the story is true? Yes or No?\n", ("Yes", "No"), (0,), sfc_prompt="Yes or No?\n"),
    Example("a", (" b c d e f", " g"), (1,), sfc_prompt=""),
    Example("Question: what is 2 + 2?\nAnswer:", (" 4", " 5", " four"), (0, 2), sfc_prompt="Answer:"),
]


def sharpened(name: str) -> tuple[torch.nn.Module, object]:
    """A tiny model with large random weights, so that positions and context change the scores a lot."""
    model, tokenizer = models.load(name)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval(), tokenizer


def reference_score(model, tokenizer, prompt: str, candidate: str, reduce: str = "mean") -> float:
    """One unpadded forward pass over prompt + candidate; log-probability of the candidate tokens."""
    p_ids = tokenizer(prompt)["input_ids"]
    f_ids = tokenizer(prompt + candidate)["input_ids"]
    assert f_ids[: len(p_ids)] == p_ids, "test strings must tokenise with a clean prompt boundary"
    n = len(f_ids) - len(p_ids)
    with torch.no_grad():
        logits = model(torch.tensor([f_ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(f_ids[1:]).unsqueeze(-1)).squeeze(-1)[-n:]
    return (lp.mean() if reduce == "mean" else lp.sum()).item()


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_batched_scores_equal_unbatched_reference(name, side):
    model, tokenizer = sharpened(name)
    got = candidate_scores(model, tokenizer, EXAMPLES, batch_size=3, padding_side=side)
    for ex, scores in zip(EXAMPLES, got, strict=True):
        ref = [reference_score(model, tokenizer, ex.prompt, c) for c in ex.candidates]
        assert scores == pytest.approx(ref, abs=2e-5)


def test_reference_detects_wrong_positions():
    """The reference is sensitive: wrong position_ids under left padding change OPT's scores visibly.

    (Only OPT: its learned positions are absolute, while Llama's rotary ones are invariant to a uniform shift.)
    """
    model, tokenizer = sharpened("tiny-opt")
    seqs = encode_pairs(tokenizer, EXAMPLES, max_length=512)
    batch = collate(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        right = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"]).logits
        wrong = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])).logits
    last = batch["attention_mask"][:, 0] == 0  # rows that carry padding
    assert (right[last, -1] - wrong[last, -1]).abs().max() > 1e-2


def test_sfc_and_demonstrations_match_reference():
    model, tokenizer = sharpened("tiny-opt")
    demos = [EXAMPLES[0], EXAMPLES[2]]
    prefix = "the movie was long and dull. It was terrible\n\nDoes this mean that the story is true? Yes or No?\nYes\n\n"
    got = candidate_scores(model, tokenizer, EXAMPLES[1:2], demos=demos, batch_size=2)
    ref = [reference_score(model, tokenizer, prefix + EXAMPLES[1].prompt, c) for c in EXAMPLES[1].candidates]
    assert got[0] == pytest.approx(ref, abs=2e-5)
    got = candidate_scores(model, tokenizer, EXAMPLES[:1], sfc=True)
    ex = EXAMPLES[0]
    ref = [reference_score(model, tokenizer, ex.prompt, c, "sum") - reference_score(model, tokenizer, ex.sfc_prompt, c, "sum")
           for c in ex.candidates]
    assert got[0] == pytest.approx(ref, abs=2e-5)


def test_accuracy_takes_argmax_and_accepts_any_gold():
    model, tokenizer = sharpened("tiny-llama")

    class Classify:
        generation = False

    scores = candidate_scores(model, tokenizer, EXAMPLES)
    expected = sum(max(range(len(s)), key=s.__getitem__) in ex.gold for s, ex in zip(scores, EXAMPLES, strict=True))
    assert evaluate(model, tokenizer, Classify(), EXAMPLES)["accuracy"] == pytest.approx(expected / len(EXAMPLES))


def test_truncation_keeps_the_candidate_and_warns_once():
    _, tokenizer = models.load("tiny-opt")
    long = Example("word " * 300 + "It was", (" terrible", " great"), (1,))
    with pytest.warns(UserWarning, match="2 of 2 inputs were longer than max_length=32"):
        seqs = encode_pairs(tokenizer, [long], max_length=32)
    full = tokenizer(long.prompt + " great")["input_ids"]
    assert list(seqs[1].ids) == full[-32:]
    assert seqs[1].n_target == len(full) - len(tokenizer(long.prompt)["input_ids"])


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_greedy_generation_matches_manual_decoding(name):
    model, tokenizer = sharpened(name)
    examples = [Example("Title: x\nQuestion: who?\nAnswer:", (), (), answers=("bob",)), Example("Hi", (), (), answers=("a",))]
    got = generate_answers(model, tokenizer, examples, batch_size=2, max_new_tokens=6)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    for ex, answer in zip(examples, got, strict=True):
        ids = tokenizer(ex.prompt)["input_ids"]
        start = len(ids)
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                if nxt in (newline, tokenizer.eos_token_id):
                    break
                ids.append(nxt)
        assert answer == tokenizer.decode(ids[start:], skip_special_tokens=True).strip().split("\n")[0].strip()


def test_f1_and_normalisation_follow_squad():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert f1_score("the cat sat", "cat sat on mat") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert f1_score("dog", "cat") == 0.0
    assert f1_score("", "") == 1.0
