"""The memory of the backward pass. Gradient checkpointing that keeps the KV cache: the shared-prompt forward of DPO and GRPO, every decoder layer
replayed in the backward pass, gives the un-checkpointed values and gradients; transformers' own checkpointing would
drop the cache there. Activation offloading: the saved tensors through torch's host-memory hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import adapter, assert_close_tensors, losses, make_cfg, shared_prompt_batch

from xgblora.adapters.lora import attach, lora_modules
from xgblora.models import pretrained
from xgblora.models.checkpointing import enable_checkpointing
from xgblora.models.scoring import completion_scores
from xgblora.optim.fo import AdamWStepper
from xgblora.recipes import sft


def loss_and_grads(model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
                   fused: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A GRPO-like weighted sum of the completions' token log-probabilities, and its gradients."""
    logps = completion_scores(model, *batch, fused=fused).logprobs
    loss = -(logps * torch.tensor([[1.0], [-0.5], [2.0], [0.3]])).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), list(torch.autograd.grad(loss, params))


def attention_calls(model: torch.nn.Module) -> list[int]:
    """A counter of the attention modules' forward calls (inside the checkpointed region: a replay runs them again)."""
    calls = [0]
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(("lora", "fused"), [(False, False), (True, False), (True, True)])
def test_checkpointed_shared_prompt_forward_equals_the_plain_one(lora, fused):
    model, _ = pretrained.random_model("tiny-llama", seed=1)
    if lora:
        attach(model, ["q_proj", "v_proj"], r=2, alpha=4)
        for module in lora_modules(model).values():  # B random: both factors get gradients
            torch.nn.init.normal_(module.lora_B)
    model.train()
    checkpointed = copy.deepcopy(model)
    enable_checkpointing(checkpointed)
    batch = shared_prompt_batch(model.config.vocab_size)
    plain_loss, plain_grads = loss_and_grads(model, batch, fused)
    calls = attention_calls(checkpointed)
    loss, grads = loss_and_grads(checkpointed, batch, fused)
    layers = model.config.num_hidden_layers
    assert calls[0] == 2 * 2 * layers  # prompt and completion pass, each run and replayed: the replay happened
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(plain_grads) > 0
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_transformers_own_checkpointing_drops_the_shared_cache():
    """Why the cache-keeping replay exists: under transformers' checkpointing a training forward returns no cache for
    the completions to run on; under ours it does."""
    model, _ = pretrained.random_model("tiny-llama", seed=1)
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    theirs.activation_checkpointing_enable()
    enable_checkpointing(ours)
    assert theirs(input_ids=ids, use_cache=True).cache is None
    assert ours(input_ids=ids, use_cache=True).cache.get_seq_length() == 5


def test_without_a_cache_it_is_plain_checkpointing():
    model, _ = pretrained.random_model("tiny-llama", seed=1)
    model.train()
    checkpointed = copy.deepcopy(model)
    enable_checkpointing(checkpointed)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum()
    calls = attention_calls(checkpointed)
    ours = checkpointed(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum()
    torch.testing.assert_close(ours, plain)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(ours, list(checkpointed.parameters())), torch.autograd.grad(plain, params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert calls[0] == 2 * model.config.num_hidden_layers


def test_train_with_gradient_checkpointing_trains_as_without(glue_data, tmp_path):
    """`xgblora train --gradient_checkpointing`: the loop checkpoints the model, and the run's losses and adapter are
    those of the run without it."""
    runs = {}
    for on in (False, True):
        out = tmp_path / str(on)
        sft.run(make_cfg(glue_data, out, method="lora", max_steps=3, logging_steps=1, save_strategy="no",
                           no_eval=True, gradient_checkpointing=on))
        runs[on] = losses(out), adapter(out)
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
    assert_close_tensors(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-6)


class _Rows:
    """A batch of rows of features, whole (one micro-batch)."""

    def __init__(self, x: torch.Tensor):
        self.x, self.n_examples = x, len(x)


def test_activation_offloading_saves_the_backwards_tensors_through_host_hooks_and_keeps_the_step(monkeypatch):
    """--activation_offloading: AdamWStepper runs the forward under torch's save_on_cpu (its pack hook sees every
    tensor saved for the backward), and the step is the plain one."""
    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Recording(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook
            self.pack_hook = lambda tensor: packed.append(tensor.shape) or pack(tensor)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recording)
    steps = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        x = torch.randn(4, 8)
        stepper = AdamWStepper(list(model.named_parameters()), lambda batch, m=model: m(batch.x).pow(2).mean(),
                               micro_batch=4, offload=offload)
        rows = _Rows(x)
        stepper.step(lambda rows=rows: rows, lr=1e-2)
        steps.append([p.detach().clone() for p in model.parameters()])
    assert packed  # the second run's saved activations went through the hook
    for plain, offloaded in zip(*steps, strict=True):
        torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)
