"""Peak memory of an instruction-SFT training step: the chunked target log-probabilities against the plain
`log_softmax(logits.float()).gather(...)`, and the fused LM head (no logits of all the targets at once) against
both, on a Llama-shaped random model with a 128k vocabulary and long targets.

Each variant runs in a fresh subprocess (LoRA on q/v, one forward and backward of the token-mean loss); the figure
is what the step adds to the memory held before it (the model): the peak RSS sampled during the step on the CPU,
max_memory_allocated on CUDA. Variants alternate over repeats.

    python benchmarks/loss_memory.py                       # 128k vocab, 4 x 1024 tokens, 768 of them targets
    python benchmarks/loss_memory.py --dtype bfloat16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

VARIANTS = ("plain", "chunked", "fused")  # plain and chunked: from the full logits


def step_peak_mb(args: argparse.Namespace, variant: str) -> float:
    """Memory (MiB) one training step of `variant` adds to what this process held before it."""
    import torch

    from xgblora.adapters.lora import attach
    from xgblora.bench.memory import added_peak_mb
    from xgblora.bench.workloads import synthetic_seqs
    from xgblora.data.collation import collate
    from xgblora.models import pretrained, scoring
    from xgblora.train.objective import TrainingLoss

    if variant == "plain":
        scoring.token_logprobs = lambda logits, targets: torch.log_softmax(
            logits[:, :targets.shape[1]].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    device = torch.device(args.device)
    pretrained.RANDOM_MODELS["llama-128k-bench"] = ("llama", dict(
        vocab_size=128256, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096))
    model, tokenizer = pretrained.random_model("llama-128k-bench", dtype=args.dtype)
    attach(model, ["q_proj", "v_proj"], r=8, alpha=16.0)
    model.to(device)
    seqs = synthetic_seqs(args.batch_size, args.seq_len, args.target_len, 128256)
    batch = collate(seqs, tokenizer.pad_token_id).token_mean().to(device)
    loss_fn = TrainingLoss(model, fused_head=variant == "fused")
    return added_peak_mb(lambda: loss_fn(batch).mean().backward(), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--target_len", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(step_peak_mb(args, args.worker)))
        return
    flags = sys.argv[1:]
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:  # alternating: both see the same machine state
            done = subprocess.run([sys.executable, __file__, *flags, "--worker", variant], check=True,
                                  capture_output=True, text=True)
            steps[variant].append(float(done.stdout.strip().splitlines()[-1]))
    logits_mb = args.batch_size * (args.target_len + 1) * 128256 * 4 / 2**20
    result = {**vars(args), "fp32_logits_mb": round(logits_mb),
              **{f"{v}_step_mb": round(statistics.median(m)) for v, m in steps.items()}}
    result["chunked_over_plain"] = round(result["chunked_step_mb"] / result["plain_step_mb"], 3)
    result["fused_over_chunked"] = round(result["fused_step_mb"] / result["chunked_step_mb"], 3)
    result.pop("worker")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
