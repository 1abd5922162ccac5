"""A fused LM head for training: the target-token log-probabilities of scored positions from their final hidden
states, projected through the output head a chunk of tokens at a time, so that no [tokens, vocab] logits tensor is
ever held, in the forward pass or in the backward one.

`fused_token_logprobs` is the kernel; `split_head` finds a causal LM's backbone and head (or says that its logits
are not the head's output alone, and the logits path must stay).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Tokens projected at a time: their fp32 logits over a 128k vocabulary are 0.5 GiB (a few copies of that in the
# backward: logits, their softmax, its gradient), against 64 GiB for 128k tokens at once.
HEAD_CHUNK_TOKENS = 1024

# Config fields of the families whose logits are more than the head's output (TRL's list): scaled or softcapped
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


def fused_token_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """log softmax(head(hidden))[target] in fp32, shape [N], for hidden states [N, H] and targets [N].

    Each chunk of `chunk` tokens (default HEAD_CHUNK_TOKENS) runs under a non-reentrant checkpoint: the forward keeps only the chunk's inputs
    and its N log-probabilities, and the backward recomputes the chunk's logits, backpropagates through them and
    frees them before the next chunk's. The peak holds one chunk's logits (and their gradient), not N rows of them;
    the price is one more head projection per token (about a third more head FLOPs).

    Against TRL's `add_fused_lm_head` (an autograd.Function over the head's weight and bias tensors, which also
    applies the logit scale and softcapping some families have) and Liger's `LigerFusedLinearCrossEntropyLoss` (a
    Triton kernel over the weight that computes the gradients in the forward pass and returns one reduced loss):
    here the head *module* is called on each chunk, so an adapter on the head (LoRALinear, PEFT's LoRA, dropout on
    it, weight-gradient hooks), a head tied to the embeddings and autocast act exactly as in the model's own
    forward; and the result is per token, so the caller weights it (per-example means, token means, packed
    sequences). Models whose logits are scaled or softcapped keep the logits path (`split_head`).
    """
    if hidden.shape[0] == 0:
        return hidden.sum(-1).float()  # empty, but connected to the graph: backward() still runs
    chunk = chunk or HEAD_CHUNK_TOKENS
    parts = [_chunk_logprobs(head, hidden[start:start + chunk], targets[start:start + chunk])
             if not torch.is_grad_enabled() else
             checkpoint(_chunk_logprobs, head, hidden[start:start + chunk], targets[start:start + chunk],
                        use_reentrant=False)
             for start in range(0, hidden.shape[0], chunk)]
    return torch.cat(parts)


def _chunk_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One chunk's log-probabilities: target logit minus logsumexp (autograd keeps the fp32 logits once, for the
    logsumexp's backward; a log_softmax would keep a second [chunk, vocab] tensor)."""
    logits = head(hidden).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


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
