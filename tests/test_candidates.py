"""Candidate scoring and generation against unbatched, hand-written references on both tiny families."""

import pytest
import torch

from xgblora.data.collation import TokenSeq, collate, demonstration_text, encode_pairs, shared_prefix_groups
from xgblora.data.tasks import Example
from xgblora.evaluation.answers import f1_score, normalize_answer
from xgblora.evaluation.candidates import candidate_scores, evaluate, generate_answers
from xgblora.models import pretrained
from xgblora.models.scoring import contiguous_head_input

EXAMPLES = [
    Example("the movie was long and dull. It was", (" terrible", " great"), (0,), sfc_prompt=" It was"),
    Example("fun!", (" terrible", " great", " not good at all"), (1,), sfc_prompt=" It was"),
    Example("Does this mean that the story is true? Yes or No?\n", ("Yes", "No"), (0,), sfc_prompt="Yes or No?\n"),
    Example("a", (" b c d e f", " g"), (1,), sfc_prompt=""),
    Example("Question: what is 2 + 2?\nAnswer:", (" 4", " 5", " four"), (0, 2), sfc_prompt="Answer:"),
]


def sharpened(name: str, raw: bool = False) -> tuple[torch.nn.Module, object]:
    """A tiny model with large random weights, so that positions and context change the scores a lot.

    raw: built without pretrained.load's set-up (no contiguous LM-head hook).
    """
    model, tokenizer = pretrained.random_model(name) if raw else pretrained.load(name)
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
def test_batched_scores_equal_unbatched_reference(name):
    model, tokenizer = sharpened(name)
    got = candidate_scores(model, tokenizer, EXAMPLES, batch_size=3)
    for ex, scores in zip(EXAMPLES, got, strict=True):
        ref = [reference_score(model, tokenizer, ex.prompt, c) for c in ex.candidates]
        assert scores == pytest.approx(ref, abs=2e-5)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_an_empty_prompt_scores_its_candidates_after_the_bos_token(prefix_cache):
    model, tokenizer = sharpened("tiny-opt")  # its tokenizer adds no BOS: the candidate would be the whole input
    empty = [Example("", (" great", " terrible"), (0,)), EXAMPLES[0]]
    got = candidate_scores(model, tokenizer, empty, batch_size=4, prefix_cache=prefix_cache)
    bos = tokenizer.bos_token
    assert got[0] == pytest.approx([reference_score(model, tokenizer, bos, c) for c in (" great", " terrible")],
                                   abs=2e-5)


def test_reference_detects_wrong_positions():
    """The reference is sensitive: wrong position_ids under left padding change OPT's scores visibly.

    (Only OPT: its learned positions are absolute, while Llama's rotary ones are invariant to a uniform shift.)
    """
    model, tokenizer = sharpened("tiny-opt")
    seqs = encode_pairs(tokenizer, EXAMPLES, max_length=512)
    batch = collate(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        right = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids).logits
        wrong = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)).logits
    last = batch.attention_mask[:, 0] == 0  # rows that carry padding
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


# Prompts of very different lengths (heavy left padding in the prompt batch), multi-token candidates, and
# candidates that merge with the prompt's last characters when tokenised together (see _split_target). No
# empty SFC prompt: the tiny tokenizer adds no BOS, so a one-token candidate after it has nothing to condition on.
VARIED = [*(ex for ex in EXAMPLES if ex.sfc_prompt), Example("word " * 40 + "so it was", (" fine", " not fine at all"), (0,), sfc_prompt="it was"),
          Example("ab", ("c", "cd", " e"), (0,), sfc_prompt="b"), Example("one", (" two",), (0,), sfc_prompt="one")]


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_prefix_cache_scores_equal_whole_sequence_scores(name):
    """The cached-prompt path scores exactly what one whole pass per pair scores, also with SFC and demos."""
    model, tokenizer = sharpened(name)
    for kwargs in ({}, {"sfc": True}, {"demos": EXAMPLES[:2], "icl_sfc": True}):
        cached = candidate_scores(model, tokenizer, VARIED, batch_size=3, **kwargs)
        whole = candidate_scores(model, tokenizer, VARIED, batch_size=3, prefix_cache=False, **kwargs)
        for got, want in zip(cached, whole, strict=True):
            assert got == pytest.approx(want, abs=2e-5), kwargs
    ex = VARIED[4]  # clean boundaries: also against the unpadded reference
    ref = [reference_score(model, tokenizer, ex.prompt, c) for c in ex.candidates]
    assert candidate_scores(model, tokenizer, VARIED, batch_size=4)[4] == pytest.approx(ref, abs=2e-5)


def test_prefix_cache_runs_each_prompt_once():
    """With the cache every prompt is fed to the model once, and identical calibration sequences once in all."""
    model, tokenizer = sharpened("tiny-llama")
    fed: list[tuple[bool, list[int]]] = []  # (against a cache, the row's real tokens)

    def record(module, args, kwargs):  # noqa: ARG001
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"][:, -kwargs["input_ids"].shape[1]:]
        cached = kwargs.get("past_key_values") is not None
        fed.extend((cached, row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        candidate_scores(model, tokenizer, EXAMPLES, batch_size=2)
        prompts = [tokenizer(ex.prompt)["input_ids"] for ex in EXAMPLES]
        assert sorted(row for cached, row in fed if not cached) == sorted(prompts)
        longest = max(len(tokenizer(ex.prompt + c)["input_ids"]) - len(p) for ex, p in zip(EXAMPLES, prompts, strict=True)
                      for c in ex.candidates)
        assert all(len(row) < longest for cached, row in fed if cached)  # candidates only, last token not fed
        fed.clear()
        same = [Example(f"text number {i}. It was", (" terrible", " great"), (0,), sfc_prompt=" It was")
                for i in range(6)]
        candidate_scores(model, tokenizer, same, sfc=True)
        assert sum(row == tokenizer(" It was")["input_ids"] for _, row in fed) == 1
    finally:
        handle.remove()


# In-context evaluation: demonstrations long enough for the shared cache (MIN_SHARED_PREFIX tokens and more)
DEMOS = [Example(f"review {i}: the plot was slow but the actors were fine. It was", (" terrible", " great"), (i % 2,),
                 sfc_prompt=" It was") for i in range(4)]


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_demonstrations_cached_once_score_what_whole_pairs_score(name):
    """The demonstrations' shared cache gives the scores and predictions of whole (demos + prompt + candidate)
    forwards, with SFC calibration against the demonstrations too; and against the unpadded reference."""
    model, tokenizer = sharpened(name)
    for kwargs in ({}, {"icl_sfc": True}, {"sfc": True}):
        cached = candidate_scores(model, tokenizer, VARIED, demos=DEMOS, batch_size=3, **kwargs)
        whole = candidate_scores(model, tokenizer, VARIED, demos=DEMOS, batch_size=3, prefix_cache=False, **kwargs)
        for got, want in zip(cached, whole, strict=True):
            assert got == pytest.approx(want, abs=2e-5), kwargs
            assert max(range(len(got)), key=got.__getitem__) == max(range(len(want)), key=want.__getitem__)
    prefix = demonstration_text(DEMOS)
    ex = VARIED[4]  # clean boundaries
    ref = [reference_score(model, tokenizer, prefix + ex.prompt, c) for c in ex.candidates]
    assert candidate_scores(model, tokenizer, VARIED, demos=DEMOS, batch_size=4)[4] == pytest.approx(ref, abs=2e-5)


def test_demonstrations_run_once_for_the_whole_evaluation():
    """Every example's prompt and the SFC calibration run against the one cache of the demonstrations: the
    demonstration tokens are fed to the model once in all."""
    model, tokenizer = sharpened("tiny-llama")
    demo_ids = tokenizer(demonstration_text(DEMOS))["input_ids"]
    fed: list[list[int]] = []

    def record(module, args, kwargs):  # noqa: ARG001
        fed.extend(row.tolist() for row in kwargs["input_ids"])

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        candidate_scores(model, tokenizer, VARIED, demos=DEMOS, batch_size=2, icl_sfc=True)
    finally:
        handle.remove()
    head = demo_ids[:16]
    assert sum(row[:16] == head for row in fed) == 1  # only the shared prefix's own forward starts with the demos
    assert len(fed) > 1 and max(len(row) for row in fed[1:]) < len(demo_ids)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_contiguous_head_input_keeps_the_logits(name):
    """The hook gives the LM head a contiguous slice under logits_to_keep, and the same logits; load() installs it."""
    model, _ = sharpened(name, raw=True)
    ids = torch.randint(3, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    seen = []
    probe = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        plain = model(input_ids=ids, logits_to_keep=4).logits
        handle = contiguous_head_input(model)
        hooked = model(input_ids=ids, logits_to_keep=4).logits
        handle.remove()
    probe.remove()
    assert seen == [False, True]
    assert torch.equal(plain, hooked)
    loaded, _ = pretrained.load(name)
    loaded.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        loaded(input_ids=ids, logits_to_keep=4)
    assert seen[-1] is True


def test_shared_prefix_groups_stop_before_scored_tokens():
    seqs = [TokenSeq((1, 2, 3, 4), 1, 0, 0), TokenSeq((1, 2, 3, 5, 6), 2, 0, 1),  # common 1 2 3, nothing scored
            TokenSeq((1, 7, 8), 2, 1, 0), TokenSeq((1, 7, 8, 9), 1, 1, 1),  # 7 8 is scored in the first
            TokenSeq((1, 2), 1, 2, 0),  # a single candidate: nothing to share
            TokenSeq((5, 2), 1, 3, 0), TokenSeq((6, 2), 1, 3, 1)]  # no common first token
    groups, alone = shared_prefix_groups(seqs)
    assert [(g.rows, g.length) for g in groups] == [((0, 1), 3), ((2, 3), 1)]
    assert alone == [4, 5, 6]


def test_accuracy_takes_argmax_and_accepts_any_gold():
    model, tokenizer = sharpened("tiny-llama")

    class Classify:
        generation = False

    scores = candidate_scores(model, tokenizer, EXAMPLES)
    expected = sum(max(range(len(s)), key=s.__getitem__) in ex.gold for s, ex in zip(scores, EXAMPLES, strict=True))
    assert evaluate(model, tokenizer, Classify(), EXAMPLES)["accuracy"] == pytest.approx(expected / len(EXAMPLES))


def test_truncation_keeps_the_candidate_and_warns_once():
    _, tokenizer = pretrained.load("tiny-opt")
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
    for ex, answer in zip(examples, got, strict=True):
        assert answer == greedy_reference(model, tokenizer, tokenizer(ex.prompt)["input_ids"], 6)


def greedy_reference(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    """Unbatched, unpadded greedy decoding from ids, stopped at a newline or end of sequence."""
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    ids, start = list(ids), len(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt in (newline, tokenizer.eos_token_id):
                break
            ids.append(nxt)
    return tokenizer.decode(ids[start:], skip_special_tokens=True).strip().split("\n")[0].strip()


def test_generation_truncates_long_prompts_from_the_left_and_warns_once():
    model, tokenizer = sharpened("tiny-opt")
    long = Example("word " * 300 + "Title: x\nQuestion: who?\nAnswer:", (), (), answers=("bob",))
    examples = [long, Example("Hi", (), (), answers=("a",)), long]
    with pytest.warns(UserWarning, match=r"2 of 3 prompts were longer than max_length - max_new_tokens = 26 tokens") \
            as caught:
        got = generate_answers(model, tokenizer, examples, batch_size=2, max_length=32, max_new_tokens=6)
    assert len([w for w in caught if "prompts were longer" in str(w.message)]) == 1
    tail = tokenizer(long.prompt)["input_ids"][-26:]  # the end of the prompt: the question and "Answer:"
    answer = greedy_reference(model, tokenizer, tail, 6)
    assert got == [answer, greedy_reference(model, tokenizer, tokenizer("Hi")["input_ids"], 6), answer]


def test_f1_and_normalisation_follow_squad():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert f1_score("the cat sat", "cat sat on mat") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert f1_score("dog", "cat") == 0.0
    assert f1_score("", "") == 1.0
