"""Activation memory of LoRA on a half-precision base: the bytes autograd keeps for the backward of one training
forward, xgblora's LoRALinear against PEFT's LoRA on the same bf16 model (adapters in fp32 in both, PEFT's default
`autocast_adapter_dtype`), and for scale the frozen model's own activations (a forward whose input embeddings
require a gradient, no adapter).

The count is exact, not an allocator reading: every tensor autograd saves passes torch's saved_tensors_hooks, and
the distinct storages among them, less the model's parameters, are summed. It is the same on any device.

    python benchmarks/lora_saved_memory.py          # llama-100m-random in bf16, 4 x 256 tokens, LoRA r=8 on q/v
"""

from __future__ import annotations

import argparse
import json

import torch

from xgblora.adapters.lora import attach
from xgblora.models import pretrained


def saved_mib(model: torch.nn.Module, forward) -> float:
    """MiB of the distinct non-parameter storages autograd saves during forward()."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values()) / 2**20


def measure(args: argparse.Namespace, variant: str) -> float:
    model, _ = pretrained.random_model(args.model, dtype=args.dtype)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.length),
                        generator=torch.Generator().manual_seed(0))
    if variant == "frozen model":
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        return saved_mib(model, lambda: model(inputs_embeds=embeds, use_cache=False).logits)
    if variant == "PEFT LoRA":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    else:
        attach(model, ["q_proj", "v_proj"], r=8, alpha=16.0)
    return saved_mib(model, lambda: model(input_ids=ids, use_cache=False).logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-100m-random", choices=sorted(pretrained.RANDOM_MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    rows = {variant: measure(args, variant) for variant in ("frozen model", "xgblora LoRA", "PEFT LoRA")}
    print(json.dumps({"model": args.model, "dtype": args.dtype, "tokens": args.batch * args.length,
                      "saved_mib": {k: round(v, 1) for k, v in rows.items()}}, indent=2))


if __name__ == "__main__":
    main()
