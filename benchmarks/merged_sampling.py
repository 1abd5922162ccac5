"""Sampling with the LoRA branches unmerged (what the sampler does) against sampling with each adapted weight merged
into a copy (base + scale B A, the base untouched): llama-100m-random, LoRA r=8 on every linear layer (B drawn
non-zero, as after training), 8 samples of 32 tokens from one 60-token prompt, interleaved repetitions.

    python benchmarks/merged_sampling.py --repeats 4
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from xgblora.adapters.lora import LoRALinear, attach, lora_modules
from xgblora.models import pretrained
from xgblora.models.sampler import Sampler, SamplingParams


@contextlib.contextmanager
def merged_copies(modules: dict[str, LoRALinear]) -> Iterator[None]:
    """Each module's forward as one linear layer of its merged weight (a copy), for the block."""
    for m in modules.values():
        weight = (m.base.weight.float() + m.delta_weight()).to(m.base.weight.dtype)
        m.forward = lambda x, weight=weight, bias=m.base.bias: F.linear(x, weight, bias)
    try:
        yield
    finally:
        for m in modules.values():
            del m.forward  # the class's forward again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = pretrained.load("llama-100m-random")
    attach(model, "all-linear", r=8, alpha=16)
    modules = lora_modules(model)
    for m in modules.values():
        torch.nn.init.normal_(m.lora_B, std=0.01)
    model.eval()
    params = SamplingParams(num_samples=8, max_new_tokens=32, temperature=1.0, seed=0)

    def sample() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            list(Sampler(model, tokenizer.pad_token_id or 0, [], params).run([list(range(100, 160))]))
        return time.perf_counter() - started

    sample()  # warm-up
    unmerged, merged = [], []
    for _ in range(args.repeats):
        unmerged.append(sample())
        with merged_copies(modules):
            merged.append(sample())
    print(f"unmerged median {statistics.median(unmerged):.2f} s, merged copies {statistics.median(merged):.2f} s: "
          f"{statistics.median(unmerged) / statistics.median(merged):.2f}x")


if __name__ == "__main__":
    main()
