"""A fused LM head for training: the target-token log-probabilities of scored positions from their final hidden
states, projected through the output head a chunk of tokens at a time, so that no [tokens, vocab] logits tensor is
ever held, in the forward pass or in the backward one.

`fused_token_logprobs` is the kernel; `split_head` finds a causal LM's backbone and head (or says that its logits
are not the head's output alone, and the logits path must stay).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# fp32 logits computed at a time: 128 MiB is 261 tokens of a 128k vocabulary, 1048 of a 32k one; the backward holds
# about two chunks of them at once (the logits and the logsumexp's temporary), against [all tokens, vocab] unfused.
HEAD_CHUNK_BYTES = 2**27

# Config fields of the families whose logits are more than the head's output (TRL's list): scaled or softcapped
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


class TokenScores(NamedTuple):
    """Per scored token: log p(target) (with gradients), and, no gradient, the entropy of the token's distribution
    and its mean logit (what GRPO and DPO log)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None


def fused_token_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int | None = None,
                         temperature: float = 1.0) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[target] in fp32, shape [N], for hidden states [N, H] and targets [N].

    Each chunk of `chunk` tokens (default `chunk_tokens(head)`: HEAD_CHUNK_BYTES of fp32 logits) runs under a
    non-reentrant checkpoint: the forward keeps only the chunk's inputs and its log-probabilities, and the backward
    recomputes the chunk's logits, turns them into their own gradient in place (`_ChunkLogprob`), backpropagates
    that through the head and frees it before the next chunk's. The peak holds one chunk's logits, not N rows of
    them; the price is one more head projection per token of every chunk but the last, whose logits are kept (its
    backward comes first). Without gradients the chunks run once, each freed before the next.

    Against TRL's `add_fused_lm_head` (an autograd.Function over the head's weight and bias tensors, which also
    applies the logit scale and softcapping some families have) and Liger's `LigerFusedLinearCrossEntropyLoss` (a
    Triton kernel over the weight that computes the gradients in the forward pass, holding the weight's gradient
    from then on, and returns one reduced loss): here the head *module* is called on each chunk, so an adapter on
    the head (LoRALinear, PEFT's LoRA, dropout on it, weight-gradient hooks), a head tied to the embeddings and
    autocast act exactly as in the model's own forward; and the result is per token, so the caller weights it
    (per-example means, token means, packed sequences). Models whose logits are scaled or softcapped keep the
    logits path (`split_head`).
    """
    return _chunked(hidden, head, targets, chunk, temperature, statistics=False)[0]


def fused_token_scores(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int | None = None,
                       temperature: float = 1.0) -> TokenScores:
    """`fused_token_logprobs`, and from the same chunk of logits each token's entropy (at temperature) and mean
    logit: the statistics GRPO and DPO log, at no more memory than the log-probabilities'."""
    return TokenScores(*_chunked(hidden, head, targets, chunk, temperature, statistics=True))


def _chunked(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int | None, temperature: float,
             statistics: bool) -> list[torch.Tensor]:
    """The chunks' outputs of `_ChunkLogprob`, each concatenated over the chunks."""
    if hidden.shape[0] == 0:
        empty = hidden.sum(-1).float()  # empty, but connected to the graph: backward() still runs
        return [empty] + [empty.detach()] * (2 * statistics)
    chunk = chunk or chunk_tokens(head)
    run = functools.partial(_chunk_scores, head, temperature=temperature, statistics=statistics)
    # Every chunk but the last recomputes its logits in the backward. The last keeps them: its backward runs first,
    # at the start of the backward pass, where a recomputed chunk would be held beside the same activations; the peak
    # is the same, and a batch of one chunk (up to 1,048 targets of a 32k vocabulary) projects through the head once.
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        piece = hidden[start:start + chunk], targets[start:start + chunk]
        recompute = torch.is_grad_enabled() and start + chunk < hidden.shape[0]
        parts.append(checkpoint(run, *piece, use_reentrant=False) if recompute else run(*piece))
    return [torch.cat(column) for column in zip(*parts, strict=True)]


def chunk_tokens(head: nn.Module) -> int:
    """Tokens a chunk of `fused_token_logprobs` projects: HEAD_CHUNK_BYTES of fp32 logits of the head's outputs."""
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    return max(1, HEAD_CHUNK_BYTES // (4 * vocab))


def _chunk_scores(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  statistics: bool) -> tuple[torch.Tensor, ...]:
    return _ChunkLogprob.apply(head(hidden), targets, temperature, statistics)


class _ChunkLogprob(torch.autograd.Function):
    """log softmax(logits / T)[target] in fp32 for one chunk [c, vocab] (and, asked for statistics, the entropy at T
    and the mean logit, no gradient); the backward writes the logits' gradient over the logits (fp32; a bf16
    chunk's fp32 copy): only this function reads them, the head's backward keeps its input and weight, not its
    output. Autograd's log_softmax + gather would hold an fp32 copy, the log-softmax and two [c, vocab] gradients."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                statistics: bool) -> tuple[torch.Tensor, ...]:
        z = logits.float() / temperature if temperature != 1.0 else logits.float()
        lse = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        logprobs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if not statistics:
            return (logprobs,)
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)  # -sum p log p, log p = z - lse
        mean_logit = logits.float().mean(-1)
        ctx.mark_non_differentiable(entropy, mean_logit)
        return logprobs, entropy, mean_logit

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = grad_out.float().unsqueeze(-1)
        z = logits.float() if t == 1.0 else logits.float().div_(t)  # in place when fp32: see the class docstring
        grad_logits = z.sub_(lse.unsqueeze(-1)).exp_().mul_(-grad)  # -softmax(z)
        grad_logits.scatter_add_(-1, targets.unsqueeze(-1), grad)  # + onehot(target)
        if t != 1.0:
            grad_logits.div_(t)  # dz/dlogits
        return grad_logits.to(logits.dtype), None, None, None


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(backbone, head) of a causal LM whose logits are head(backbone(...).last_hidden_state), PEFT-wrapped or not;
    None where they are not (scaled or softcapped logits, no separate head, a compiled model, whose forward the
    backbone's would bypass)."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the patched model
    config = getattr(inner, "config", None)
    if config is None or not hasattr(inner, "get_output_embeddings"):
        return None
    text = config.get_text_config()
    if any(getattr(text, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return None
    head, backbone = inner.get_output_embeddings(), getattr(inner, "base_model", None)
    if not isinstance(head, nn.Module) or not isinstance(backbone, nn.Module) or backbone is inner:
        return None
    return backbone, head
