"""Text embeddings: the pooled, normalised representation of right-padded inputs (mean, CLS or last token), with
bidirectional attention for a causal LM where it allows it (GritLM's embedding pass), and batched encoding of texts.

Every path that embeds goes through `embed`: training's contrastive loss, retrieval evaluation, `xgblora encode`.
An instruction prefix is always attended to; `skip` leaves its tokens out of the mean pooling, as GritLM does
(ContextualAI/gritlm, gritlm/training/model.py `encode`: the instruction positions zeroed in the pooling mask) and
sentence-transformers' Pooling(include_prompt=False).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from xgblora.data.pairs import pad_right, prefix_length, tokenize
from xgblora.models.scoring import eval_mode, pool

POOLINGS = ("mean", "cls", "last")


def body(model: nn.Module) -> nn.Module:
    """The transformer without its LM or task head (BertModel of BertModel, LlamaModel of LlamaForCausalLM)."""
    return getattr(model, "base_model", model)


def bidirectional_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A 4D additive mask [B, 1, T, T] in which every token sees every non-padding token (no causal triangle).

    Hugging Face models take a 4D mask as it is (masking_utils); SDPA and eager attention both add it."""
    keep = attention_mask[:, None, None, :].to(torch.bool)
    blocked = torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device)
    mask = blocked.masked_fill(~keep, torch.finfo(dtype).min)
    return mask.expand(-1, 1, attention_mask.shape[1], -1)


def hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, bidirectional: bool = False) -> Tensor:
    """Last hidden states [B, T, H] of right-padded inputs; bidirectional: a causal LM attends both ways."""
    net = body(model)
    mask = bidirectional_mask(attention_mask, net.get_input_embeddings().weight.dtype) if bidirectional \
        else attention_mask
    return net(input_ids=input_ids, attention_mask=mask).last_hidden_state


def pooling_mask(attention_mask: Tensor, skip: int) -> Tensor:
    """The attention mask without each row's first `skip` tokens (its instruction), a row's last token always kept
    (a text cut to nothing by max_length still pools its last token)."""
    if skip == 0:
        return attention_mask
    lengths = attention_mask.sum(1, keepdim=True)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :]
    return attention_mask * (positions >= torch.clamp(lengths - 1, max=skip))


def embed(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, pooling: str,
          bidirectional: bool = False, skip: int = 0, normalize: bool = True) -> Tensor:
    """Unit-length embeddings [B, H] (fp32) of right-padded inputs, pooled by 'mean', 'cls' or 'last'; the first
    `skip` tokens (an instruction prefix) are attended to but not pooled. normalize false: the pooled vectors as
    they are (Matryoshka's loss cuts them first, then normalises each cut)."""
    hidden = hidden_states(model, input_ids, attention_mask, bidirectional)
    pooled = hidden[:, 0] if pooling == "cls" else pool(hidden, pooling_mask(attention_mask, skip), pooling)
    return nn.functional.normalize(pooled.float(), dim=-1) if normalize else pooled.float()


def bidirectional_supported(model: nn.Module) -> bool:
    """Whether the 4D mask really makes attention bidirectional: changing the last token must change the first
    token's hidden state (it cannot under a causal mask). Runs two tiny forwards."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab, 4 % vocab]], device=next(model.parameters()).device)
    changed = ids.clone()
    changed[0, -1] = 5 % vocab
    mask = torch.ones_like(ids)
    try:
        with torch.no_grad(), eval_mode(model):
            first = [hidden_states(model, x, mask, bidirectional=True)[0, 0] for x in (ids, changed)]
    except (RuntimeError, ValueError, TypeError):  # a model (or attention kernel) that refuses a 4D mask
        return False
    return not torch.allclose(first[0], first[1])


@torch.no_grad()
def encode_texts(model: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, pooling: str,
                 max_length: int, batch_size: int = 32, bidirectional: bool = False, prefix: str = "",
                 include_prompt: bool = True) -> Tensor:
    """Unit-length embeddings [N, H] of texts (prefix prepended, and pooled unless include_prompt is false), in eval
    mode, longest first to pad little."""
    rows = tokenize(tokenizer, [prefix + t for t in texts], max_length)
    skip = 0 if include_prompt else prefix_length(tokenizer, prefix)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    device = next(model.parameters()).device
    out: list[Tensor] = [torch.empty(0)] * len(rows)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            ids, mask = pad_right([rows[i] for i in chunk], tokenizer.pad_token_id)
            vectors = embed(model, ids.to(device), mask.to(device), pooling, bidirectional, skip).cpu()
            for i, v in zip(chunk, vectors, strict=True):
                out[i] = v
    return torch.stack(out) if out else torch.empty(0, 0)
