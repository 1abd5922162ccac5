"""Model FLOPs per token from a model's config, and MFU: the share of the device's peak that a throughput reaches.

The count is PaLM's (Chowdhery et al. 2022, appendix B), per token of a sequence of T tokens:
    forward          2 N + 4 L T d
    training (full)  3 x forward = 6 N + 12 L T d
    training (LoRA)  4 N + 12 L T d + 6 N_lora: the frozen weights take no weight gradient (forward 2 N, input
                     gradient 2 N); the adapters' factors take all three products (2 N_lora each)
where N counts the weights that multiply every token (the blocks' linear layers and the LM head; not the input
embedding, a lookup), L the layers, d the attention width (heads x head size). The attention term counts Q K^T
and the weighted sum of V over all T x T pairs, causal masking not discounted, as PaLM does. The LM head counts at
every position, also where a step computes it for the scored ones only (`logits_to_keep`): the model's FLOPs, not
the implementation's, so that two implementations' MFU compare as their throughputs do.

Peak: dense bf16 tensor-core FLOP/s of the GPU, from its name (the vendors' data sheets, without sparsity).
"""

from __future__ import annotations

from typing import Any

import torch

LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "smollm3"})
ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra", "mpnet"})

# (substring of torch.cuda.get_device_name, dense bf16 TFLOP/s); the first match wins, so H100 NVL / PCIe come
# before the SXM part, whose name ("NVIDIA H100 80GB HBM3") has neither
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("GH200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("H800", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
    ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0),
)


def _attention_width(config: Any) -> int:
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def matmul_params(config: Any, lm_head: bool = True) -> int:
    """N: the weights of the linear layers every token passes through (biases left out), from the config; the LM
    head's with `lm_head` (causal LMs). Llama-like, OPT and BERT-like encoders."""
    d, layers, t = config.hidden_size, config.num_hidden_layers, config.model_type
    if t in LLAMA_LIKE:
        width = _attention_width(config)
        kv = (config.num_key_value_heads or config.num_attention_heads) * (width // config.num_attention_heads)
        block = 2 * d * width + 2 * d * kv + 3 * d * config.intermediate_size
        head = d * config.vocab_size
    elif t == "opt":
        proj = config.word_embed_proj_dim
        block = 4 * d * d + 2 * d * config.ffn_dim
        head = proj * config.vocab_size + (2 * d * proj if proj != d else 0)  # project_in / project_out
    elif t in ENCODERS:
        block, head = 4 * d * d + 2 * d * config.intermediate_size, 0  # an embedding model's body: no head
    else:
        raise ValueError(f"no FLOP count for model type {t!r} (llama-like, opt and bert-like encoders)")
    return layers * block + (head if lm_head else 0)


def flops_per_token(config: Any, seq_len: int, kind: str = "forward", lora_params: int = 0,
                    lm_head: bool = True) -> float:
    """Model FLOPs per token of a sequence of seq_len tokens: kind 'forward', 'train_full' or 'train_lora'
    (lora_params: the adapters' factor weights, N_lora)."""
    n = matmul_params(config, lm_head)
    attention = 4 * config.num_hidden_layers * seq_len * _attention_width(config)
    if kind == "forward":
        return 2 * n + attention
    if kind == "train_full":
        return 6 * n + 3 * attention
    if kind == "train_lora":
        return 4 * n + 3 * attention + 6 * lora_params
    raise ValueError(f"kind must be forward, train_full or train_lora, not {kind!r}")


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, None where unknown (the CPU, a GPU missing from the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def mfu(tokens_per_s: float, per_token: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation: tokens/s x model FLOPs per token over the peak; None where the peak is unknown."""
    peak = peak_flops(device)
    return tokens_per_s * per_token / peak if peak else None
