"""The fused LM head: the chunked projection gives the full logits' log-probabilities and gradients (hidden states,
head weight and bias, a tied head, LoRA on the head), SFT batches score the same through it, padded and packed, and
a run trains the same with it on and off."""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers import adapter, losses, make_cfg, shared_prompt_batch
from torch import nn

from xgblora.adapters.lora import attach
from xgblora.bench import flags, sft
from xgblora.data.tasks import Example
from xgblora.models import fused_head, pretrained, scoring
from xgblora.models.fused_head import fused_token_logprobs, split_head
from xgblora.recipes.sft import run
from xgblora.train.objective import causal_training_set, per_example_loss

INSTRUCTIONS = [Example(p, (), (), answers=(a,)) for p, a in [
    ("Question: what is the best film of the year? Answer:", "the one about love and fun"),
    ("Q: yes or no? A:", "yes"),
    ("Summarise: a long and boring story, dull acting, a bad plot. Summary:", "bad"),
    ("Title: a good time. Text:", "a funny and well made movie, the best story we have seen"),
]]


def plain_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """The unchunked reference: full logits, then cross-entropy."""
    return -nn.functional.cross_entropy(head(hidden).float(), targets, reduction="none")


def grads(value: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(value, tensors)


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 100])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(chunk):
    torch.manual_seed(0)
    head = nn.Linear(16, 50)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    weights = torch.rand(37)  # any downstream weighting: per-example means, token means
    fused = fused_token_logprobs(hidden, head, targets, chunk=chunk)
    plain = plain_logprobs(hidden, head, targets)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    tensors = [hidden, head.weight, head.bias]
    for a, b in zip(grads((fused * weights).sum(), tensors), grads((plain * weights).sum(), tensors), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("chunk", "chunks"), [(5, 8), (37, 1), (100, 1)])
def test_every_chunk_but_the_last_projects_again_in_the_backward(chunk, chunks):
    """The last chunk keeps its logits for the backward (it comes first there); the others recompute theirs."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    hidden = torch.randn(37, 16, requires_grad=True)
    fused_token_logprobs(hidden, head, torch.randint(0, 50, (37,)), chunk=chunk).sum().backward()
    assert len(calls) == 2 * chunks - 1


def test_no_scored_token_gives_a_differentiable_zero():
    head = nn.Linear(8, 20)
    hidden = torch.randn(0, 8, requires_grad=True)
    out = fused_token_logprobs(hidden, head, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,) and out.dtype == torch.float32
    out.sum().backward()


def test_tied_head_gets_the_embedding_and_head_gradients():
    torch.manual_seed(1)
    embed = nn.Embedding(40, 12)
    head = nn.Linear(12, 40, bias=False)
    head.weight = embed.weight  # tied: one parameter read twice
    ids = torch.randint(0, 40, (23,))
    targets = torch.randint(0, 40, (23,))
    fused = fused_token_logprobs(torch.tanh(embed(ids)), head, targets, chunk=6).sum()
    plain = plain_logprobs(torch.tanh(embed(ids)), head, targets).sum()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads(fused, [embed.weight])[0], grads(plain, [embed.weight])[0],
                               rtol=1e-5, atol=1e-6)


def tiny(name: str = "tiny-llama", targets: str | None = None, **overrides):
    model, tokenizer = pretrained.random_model(name, seed=2, **overrides)
    modules = attach(model, targets, r=4).modules
    torch.manual_seed(0)
    with torch.no_grad():  # B = 0 would leave A without gradient
        for m in modules.values():
            m.lora_B.normal_(0, 0.1)
    return model, tokenizer, [p for m in modules.values() for p in (m.lora_A, m.lora_B)]


def assert_same_loss_and_grads(model: nn.Module, batch, params: list[torch.Tensor]) -> None:
    fused = per_example_loss(model, batch, fused_head=True)
    plain = per_example_loss(model, batch, fused_head=False)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads(fused.mean(), params), grads(plain.mean(), params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 7 tokens: a padded batch's scored tokens never fill the last one."""
    monkeypatch.setattr(fused_head, "chunk_tokens", lambda head: 7)


def counted(monkeypatch) -> list[int]:
    """Count the fused head's calls from scoring (a silent fall-back to the logits would pass the equality)."""
    calls: list[int] = []

    def fused(hidden, head, targets, chunk=None):
        calls.append(hidden.shape[0])
        return fused_token_logprobs(hidden, head, targets, chunk)

    monkeypatch.setattr(scoring, "fused_token_logprobs", fused)
    return calls


@pytest.mark.parametrize(("name", "packed", "token_mean"), [
    ("tiny-llama", False, False), ("tiny-llama", False, True), ("tiny-llama", True, False), ("tiny-opt", False, True)])
def test_sft_batches_score_the_same_through_the_fused_head(small_chunks, monkeypatch, name, packed, token_mean):
    model, tokenizer, params = tiny(name)
    model.eval()  # OPT's dropout would draw differently in the two forwards (gradients flow in eval mode too)
    batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False, packed=packed, token_mean=token_mean).batch(
        [2, 0, 3, 1])
    calls = counted(monkeypatch)
    assert_same_loss_and_grads(model, batch, params)
    n_targets = int(batch.target_index.numel() if packed else batch.target_mask.sum())
    assert calls == [n_targets]  # only the scored positions went through the head
    assert n_targets % 7


@pytest.mark.parametrize("tied", [False, True])
def test_lora_on_the_head_trains_the_same(small_chunks, monkeypatch, tied):
    model, tokenizer, params = tiny(targets=["q_proj", "lm_head"], tie_word_embeddings=tied)
    assert (model.lm_head.base.weight is model.model.embed_tokens.weight) == tied
    batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False).batch([0, 1, 2, 3])
    calls = counted(monkeypatch)
    assert_same_loss_and_grads(model, batch, params)
    assert calls
    # the head's weight-gradient hook (XGBLoRA's booster start) sees each chunk once, not its recomputation too
    head = model.lm_head
    taken = []
    for fused in (True, False):
        head.start_weight_grad()
        per_example_loss(model, batch, fused_head=fused).mean().backward()
        taken.append(head.take_weight_grad())
    torch.testing.assert_close(taken[0], taken[1], rtol=1e-5, atol=1e-6)


def test_models_whose_logits_are_not_the_heads_output_keep_the_logits():
    model, _ = pretrained.random_model("tiny-llama")
    assert split_head(model) == (model.model, model.lm_head)
    model.config.final_logit_softcapping = 30.0
    assert split_head(model) is None
    model.config.final_logit_softcapping = None
    assert split_head(torch.compile(model)) is None


def test_without_gradients_the_logits_path_runs(monkeypatch):
    model, tokenizer, _ = tiny()
    batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False).batch([0, 1])
    calls = counted(monkeypatch)
    with torch.no_grad():  # MeZO's forwards: the dual LoRA mode splits the batch's rows
        per_example_loss(model, batch, fused_head=True)
    assert not calls


@pytest.mark.parametrize("packing", [False, True])
def test_a_run_trains_the_same_with_and_without_the_fused_head(glue_data, tmp_path, monkeypatch, packing):
    cfg = dict(model_name="tiny-llama", max_steps=6, logging_steps=1, save_strategy="no", no_eval=True,
               packing=packing)
    calls = counted(monkeypatch)
    run(make_cfg(glue_data, tmp_path / "fused", **cfg))
    assert calls
    calls.clear()
    run(make_cfg(glue_data, tmp_path / "plain", fused_lm_head=False, **cfg))
    assert not calls
    fused, plain = losses(tmp_path / "fused"), losses(tmp_path / "plain")
    assert len(fused) == 6
    assert fused == pytest.approx(plain, rel=1e-5, abs=1e-6)
    trained = adapter(tmp_path / "fused")
    for key, value in adapter(tmp_path / "plain").items():
        torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-6)


def test_bench_sft_measures_the_full_logits_as_the_logits_variants():
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--suite", "sft", "--sft_models", "tiny-llama", "--sft_variants", "padded",
                              "padded+logits", "packed+gc+logits"])
    cases = sft.cases(args)
    assert [(c.variant, c.fused_head, c.checkpointing, c.packed) for c in cases] == [
        ("padded", True, False, False), ("padded+logits", False, False, False),
        ("packed+gc+logits", False, True, True)]


def test_bf16_autocast_scores_about_the_same(small_chunks, monkeypatch):
    model, tokenizer, params = tiny(targets=["q_proj", "lm_head"])
    batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False, token_mean=True).batch([0, 1, 2, 3])
    calls = counted(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = per_example_loss(model, batch, fused_head=True)
        plain = per_example_loss(model, batch, fused_head=False)
    assert calls and fused.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=1e-2, atol=1e-2)  # bf16 logits: rounded per chunk shape
    for a, b in zip(grads(fused.mean(), params), grads(plain.mean(), params), strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=1e-3)


def test_a_peft_wrapped_model_with_lora_on_the_head(small_chunks, monkeypatch):
    peft = pytest.importorskip("peft")
    model, tokenizer = pretrained.random_model("tiny-llama", seed=2)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)  # B != 0
    model = peft.get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    assert split_head(model)[1] is model.get_base_model().lm_head
    batch = causal_training_set(tokenizer, INSTRUCTIONS, 64, False).batch([0, 1, 2, 3])
    calls = counted(monkeypatch)
    assert_same_loss_and_grads(model, batch, params)
    assert calls


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_scores_are_the_same_through_the_fused_head(small_chunks, monkeypatch, temperature):
    """DPO's and GRPO's completions (a shared prompt's KV cache, LoRA on the head): log-probabilities at temperature,
    their gradients, and the logged entropy and mean logit, fused as through the full logits."""
    model, _, params = tiny(targets=["q_proj", "lm_head"])
    batch = shared_prompt_batch(model.config.vocab_size)
    calls = []
    monkeypatch.setattr(scoring, "fused_token_scores",
                        lambda hidden, *args, **kw: calls.append(len(hidden)) or fused_head.fused_token_scores(
                            hidden, *args, **kw))
    fused = scoring.completion_scores(model, *batch, temperature, statistics=True, fused=True)
    plain = scoring.completion_scores(model, *batch, temperature, statistics=True, fused=False)
    assert calls == [int(batch[-1].sum())]  # the completion tokens only went through the head
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    weights = torch.randn(fused.logprobs.shape, generator=torch.Generator().manual_seed(0))
    for a, b in zip(grads((fused.logprobs * weights).sum(), params), grads((plain.logprobs * weights).sum(), params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # float32 sums of 23 tokens


def test_fused_statistics_follow_their_formulas():
    """The chunk's entropy at temperature T and mean logit against torch's softmax of the full logits."""
    torch.manual_seed(4)
    head = nn.Linear(8, 30)
    hidden, targets = torch.randn(11, 8), torch.randint(0, 30, (11,))
    scores = fused_head.fused_token_scores(hidden, head, targets, chunk=4, temperature=0.5)
    logits = head(hidden).detach()
    logp = torch.log_softmax(logits / 0.5, -1)
    torch.testing.assert_close(scores.logprobs, logp.gather(1, targets[:, None]).squeeze(1))
    torch.testing.assert_close(scores.entropy, -(logp.exp() * logp).sum(-1))
    torch.testing.assert_close(scores.mean_logit, logits.mean(-1))
