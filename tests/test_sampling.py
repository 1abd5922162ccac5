"""The sampler against references: transformers' greedy `generate`, a teacher-forced forward of each sample, and
the temperature / top-p distribution computed by hand."""

import pytest
import torch

from xgblora.adapters.lora import MemberRows, attach
from xgblora.models import pretrained
from xgblora.models.pretrained import random_model
from xgblora.models.sampler import Sampler, SamplingParams, batch_generator, plan_batches

TEXTS = ["Hello there, how are", "A", "The quick brown fox jumps over the lazy", "Question: what is 2 + 3? Answer:",
         "positive negative"]


def _model(name: str):
    model, tokenizer = random_model(name)
    return model.eval(), tokenizer


def _all_samples(sampler: Sampler, prompts, **kwargs) -> dict[int, list]:
    return {i: s for batch, samples in sampler.run(prompts, **kwargs) for i, s in zip(batch, samples, strict=True)}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_greedy_matches_transformers_generate_with_rows_leaving_the_batch(name):
    model, tokenizer = _model(name)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    first = model.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)[0, len(prompts[0]):].tolist()
    stop = first[3]  # a token greedy decoding emits, so some rows stop early and leave the batch
    params = SamplingParams(max_new_tokens=10, max_batch_tokens=3 * 20)  # several batches of up to 3 prompts
    got = _all_samples(Sampler(model, tokenizer.pad_token_id, [stop], params), prompts)
    for i, ids in enumerate(prompts):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=stop,
                             pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        [sample] = got[i]
        stopped = stop in ref
        assert list(sample.token_ids) == (ref[:ref.index(stop)] if stopped else ref)
        assert sample.finish_reason == ("stop" if stopped else "length")
    assert any(s.finish_reason == "stop" for [s] in got.values())


def test_each_sample_logprob_equals_a_teacher_forced_forward():
    model, tokenizer = _model("tiny-llama")
    prompts = [tokenizer.encode(t) for t in TEXTS]
    stops = [5, 17, 33, 60]  # frequent enough under temperature 1.5 that samples end at different steps
    params = SamplingParams(num_samples=4, max_new_tokens=8, temperature=1.5, seed=3, max_batch_tokens=200)
    got = _all_samples(Sampler(model, tokenizer.pad_token_id, stops, params), prompts)
    reasons = set()
    for i, ids in enumerate(prompts):
        for sample in got[i]:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids + list(sample.token_ids)])).logits[0].double(), -1)
            expected = sum(float(logprobs[len(ids) - 1 + t, tok]) for t, tok in enumerate(sample.token_ids))
            if sample.finish_reason == "stop":  # the summed log-prob also holds the stop token the sampler drew
                assert min(abs(sample.logprob - expected - float(logprobs[-1, s])) for s in stops) < 1e-4
            else:
                assert sample.logprob == pytest.approx(expected, abs=1e-4)
            reasons.add(sample.finish_reason)
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize("draws", ["batch generator", "prompt seed"])
def test_temperature_and_top_p_draw_from_the_filtered_distribution(draws):
    model, tokenizer = _model("tiny-llama")
    ids = tokenizer.encode("The movie was")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    temperature, top_p = 0.05, 0.8  # a peaked distribution: a handful of tokens survive top-p
    probs = torch.softmax(logits / temperature, -1)
    ranked, order = probs.sort(descending=True)
    kept = (ranked.cumsum(0) - ranked) < top_p  # the smallest set whose probability reaches top_p
    expected = torch.zeros_like(probs)
    expected[order[kept]] = ranked[kept] / ranked[kept].sum()
    n = 4000
    params = SamplingParams(num_samples=n, max_new_tokens=1, temperature=temperature, top_p=top_p,
                            max_batch_tokens=n * (len(ids) + 1))
    sampler = Sampler(model, tokenizer.pad_token_id, [], params)
    [samples] = sampler.sample_batch([ids], batch_generator(0, 0, "cpu") if draws == "batch generator" else [5])
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in samples]), minlength=len(probs)).double() / n
    assert int(kept.sum()) > 1
    assert (counts - expected).abs().sum() / 2 < 0.04  # total variation; its sampling noise at n=4000 is ~0.01
    assert counts[expected == 0].sum() == 0


def test_same_seed_same_samples_and_skipped_batches_leave_the_others_unchanged():
    model, tokenizer = _model("tiny-llama")
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(num_samples=2, max_new_tokens=5, temperature=1.0, seed=7, max_batch_tokens=2 * 2 * 20)
    plan = plan_batches([len(p) for p in prompts], params)
    assert len(plan) > 2
    full = _all_samples(Sampler(model, tokenizer.pad_token_id, [], params), prompts)
    resumed = _all_samples(Sampler(model, tokenizer.pad_token_id, [], params), prompts, skip=set(plan[0]))
    assert set(resumed) == set(full) - set(plan[0])
    assert all(resumed[i] == full[i] for i in resumed)
    other_seed = _all_samples(Sampler(model, tokenizer.pad_token_id, [], SamplingParams(
        num_samples=2, max_new_tokens=5, temperature=1.0, seed=8, max_batch_tokens=80)), prompts)
    assert any(other_seed[i] != full[i] for i in full)


def test_a_prompt_with_a_seed_draws_the_same_samples_in_any_batch_and_order():
    """Rows that stop leave the batch at different steps in each plan; a prompt's samples stay its own."""
    model, tokenizer = _model("tiny-llama")
    prompts = [tokenizer.encode(t) for t in TEXTS]
    seeds = [11, 12, 13, 14, 15]
    stops = [5, 17, 33, 60]

    def drawn(order, max_batch_tokens):
        params = SamplingParams(num_samples=3, max_new_tokens=8, temperature=1.5, top_p=0.9,
                                max_batch_tokens=max_batch_tokens)
        got = _all_samples(Sampler(model, tokenizer.pad_token_id, stops, params), [prompts[i] for i in order],
                           seeds=[seeds[i] for i in order])
        return {i: [(s.token_ids, s.finish_reason) for s in got[k]] for k, i in enumerate(order)}

    together = drawn(range(5), 10_000)
    assert drawn([4, 2, 0], 1) == {i: together[i] for i in (4, 2, 0)}  # each alone, in another order
    assert drawn([3, 1, 4, 0, 2], 3 * 2 * 20) == together  # other batches
    assert {r for samples in together.values() for _, r in samples} == {"stop", "length"}
    assert len({ids for samples in together.values() for ids, _ in samples}) == 15  # all different


def test_the_plan_keeps_every_batch_within_its_token_budget():
    lengths = [30, 5, 12, 12, 50, 1, 7, 29]
    params = SamplingParams(num_samples=3, max_new_tokens=10, max_batch_tokens=400)
    plan = plan_batches(lengths, params)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert len(batch) == 1 or len(batch) * 3 * (max(lengths[i] for i in batch) + 10) <= 400
    assert plan[0][0] == 4  # longest first


def test_the_sampler_uses_no_argument_announced_for_removal():
    """transformers announces removals with FutureWarning (`past_key_values` -> `cache`); none may be raised."""
    import warnings

    model, _ = pretrained.load("tiny-llama")
    params = SamplingParams(num_samples=2, max_new_tokens=3, temperature=1.0, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        samples = Sampler(model, 0, [2], params).sample_batch([[1, 5, 6]], batch_generator(0, 0, torch.device("cpu")))
    assert len(samples[0]) == 2


def test_rows_on_their_own_members_adapters_sample_as_each_member_alone():
    """ES's batched members: K copies of the prompts in one sampling, each row's LoRA factors its member's (told by
    on_rows through length-sorted batches and dropped rows), draw what each member draws alone (same seeds)."""
    model, tokenizer = _model("tiny-llama")
    modules = attach(model, r=2, alpha=4.0).modules
    gen = torch.Generator().manual_seed(0)
    factors = {n: [(torch.randn(m.lora_A.shape, generator=gen), torch.randn(m.lora_B.shape, generator=gen))
                   for _ in range(3)] for n, m in modules.items()}
    prompts = [tokenizer.encode(t) for t in TEXTS]
    seeds = [21, 22, 23, 24, 25]
    params = SamplingParams(num_samples=2, max_new_tokens=8, temperature=1.5, max_batch_tokens=4 * 2 * 20)
    sampler = Sampler(model, tokenizer.pad_token_id, [5, 17, 33, 60], params)
    alone = []
    for k in range(3):
        with torch.no_grad():
            for n, m in modules.items():
                m.lora_A.copy_(factors[n][k][0])
                m.lora_B.copy_(factors[n][k][1])
        alone.append(_all_samples(sampler, prompts, seeds=seeds))
    rows = MemberRows()
    for n, m in modules.items():
        m.set_members(torch.stack([A for A, _ in factors[n]]), torch.stack([B for _, B in factors[n]]), rows)
    seen = []

    def follow(positions):
        seen.append(len(positions))
        rows.index = positions // len(prompts)

    together = _all_samples(sampler, prompts * 3, seeds=seeds * 3, on_rows=follow)
    for k in range(3):
        for i in range(len(prompts)):
            got, own = together[k * len(prompts) + i], alone[k][i]
            assert [(s.token_ids, s.finish_reason) for s in got] == [(s.token_ids, s.finish_reason) for s in own]
            assert [s.logprob for s in got] == pytest.approx([s.logprob for s in own], abs=1e-5)
    assert len(set(seen)) > 2  # batches of several sizes, rows dropped as they stopped
    assert {s.finish_reason for samples in together.values() for s in samples} == {"stop", "length"}
    assert alone[0] != alone[1]
