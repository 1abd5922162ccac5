"""Samples/s and peak memory of xgblora's sampler against `model.generate(..., num_return_sequences=N)`.

Same model (a Llama-shaped random model of about 110M parameters, 32k vocabulary), same prompts (GSM8K test
questions through TinyLlama-Chat's template), same sampling (temperature, top-p, max new tokens), same batch of
prompts; timed interleaved, one variant after the other, over repeats. A random model has no reason to stop, so
a set of stop tokens is drawn (`--stop_share` of the vocabulary) to give completions of varied length, as real
answers have; both variants stop at the same tokens. Peak memory: each variant once more in a fresh process, the
peak RSS sampled during the call minus the RSS before it (CPU), or max_memory_allocated (CUDA).

    python benchmarks/sampling.py --num_samples 8
    python benchmarks/sampling.py --num_samples 16 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = ("hf_generate", "xgblora")
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def build(args: argparse.Namespace):
    """The model, the tokenised prompts and the stop tokens of a run."""
    import torch

    from xgblora.data import formats
    from xgblora.data.tasks import Example
    from xgblora.models import pretrained

    pretrained.RANDOM_MODELS["llama-110m-bench"] = ("llama", dict(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True))
    model, tokenizer = pretrained.random_model("llama-110m-bench", dtype=args.dtype)
    tokenizer.chat_template = pretrained.ZEPHYR_CHAT_TEMPLATE
    model.to(args.device).eval()
    questions = [json.loads(line)["question"] for line in
                 (Path(args.data) / "gsm8k" / "test.jsonl").read_text().splitlines()[:args.prompts]]
    prompts = [formats.generation_prompt_ids(tokenizer, Example(q, (), ())) for q in questions]
    stops = torch.randperm(32000, generator=torch.Generator().manual_seed(0))[:int(32000 * args.stop_share)].tolist()
    return model, tokenizer, prompts, stops


def workload(args: argparse.Namespace, variant: str):
    """A function that draws num_samples completions of every prompt with the variant."""
    import torch

    from xgblora.models.sampler import Sampler, SamplingParams

    model, tokenizer, prompts, stops = build(args)
    if variant == "xgblora":
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        params = SamplingParams(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p,
                                max_batch_tokens=len(prompts) * args.num_samples * longest)  # one batch, as HF's
        sampler = Sampler(model, tokenizer.pad_token_id, stops, params)
        return lambda: list(sampler.run(prompts))
    enc = tokenizer.pad({"input_ids": prompts}, padding=True, padding_side="left", return_tensors="pt").to(args.device)

    def hf_generate():
        with torch.inference_mode():
            return model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0,
                                  num_return_sequences=args.num_samples, max_new_tokens=args.max_new_tokens,
                                  eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, use_cache=True)

    return hf_generate


def peak_mb(args: argparse.Namespace, variant: str) -> float:
    """Memory one call of the variant adds to what the process held before it (MiB)."""
    import torch

    from xgblora.bench.memory import added_peak_mb

    return added_peak_mb(workload(args, variant), torch.device(args.device))


def timings(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per call of each variant, interleaved over the repeats (one untimed warm-up round)."""
    import torch

    from xgblora.bench.timing import time_interleaved

    torch.manual_seed(0)
    workloads = {v: workload(args, v) for v in VARIANTS}
    return time_interleaved(workloads, args.repeats, warmup=1, device=torch.device(args.device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--stop_share", type=float, default=0.03, help="share of the vocabulary that ends a sample")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default=str(SHARED_DATA))
    parser.add_argument("--memory_of", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps(peak_mb(args, args.memory_of)))
        return
    seconds = {v: statistics.median(t) for v, t in timings(args).items()}
    memory = {}
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--memory_of", variant], check=True,
                              capture_output=True, text=True)
        memory[variant] = round(float(done.stdout.strip().splitlines()[-1]))
    samples = args.prompts * args.num_samples
    result = {**{k: v for k, v in vars(args).items() if k not in ("memory_of", "data")},
              **{f"{v}_samples_per_s": round(samples / s, 2) for v, s in seconds.items()},
              **{f"{v}_peak_mb": memory[v] for v in VARIANTS},
              "speedup": round(seconds["hf_generate"] / seconds["xgblora"], 2)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
