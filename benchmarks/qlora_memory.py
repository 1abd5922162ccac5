"""Peak memory of a MeZO step on a 4-bit (NF4) base with LoRA on q/v, against 4-bit inference and bf16 inference,
on a Llama-shaped random model. Each mode runs in a fresh subprocess; the figure is the peak RSS sampled while the
model runs (CPU), max_memory_allocated on CUDA, after the model is loaded, minus the memory before it was
built: the resident model plus what the forward or the step adds (a built-in model is built in bf16 and then
quantised; that transient is not counted).

    python benchmarks/qlora_memory.py                          # 8 layers of hidden 1024, 32k vocabulary
    python benchmarks/qlora_memory.py --device cuda --layers 16 --hidden 2048
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

MODES = ("bf16_inference", "nf4_inference", "nf4_mezo_step")


def measure(args: argparse.Namespace, mode: str) -> dict[str, float]:
    """Load the model for `mode`, run one forward (inference) or one MeZO step; return the memory it took (MiB)."""
    import torch

    from xgblora.adapters.lora import attach
    from xgblora.bench.memory import RssSampler, _rss_mb
    from xgblora.bench.workloads import synthetic_seqs
    from xgblora.data.collation import collate
    from xgblora.models import pretrained
    from xgblora.optim.zo import MeZO
    from xgblora.train.objective import TrainingLoss

    device = torch.device(args.device)
    pretrained.RANDOM_MODELS["llama-bench"] = ("llama", dict(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(2.6875 * args.hidden) // 32 * 32,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
        max_position_embeddings=4096))
    before = torch.cuda.memory_allocated() / 2**20 if device.type == "cuda" else _rss_mb()
    nf4 = mode.startswith("nf4")
    model, tokenizer = pretrained.load("llama-bench", dtype="bfloat16", device=args.device, load_in_4bit=nf4,
                                   compute_dtype="bfloat16")
    gc.collect()
    seqs = synthetic_seqs(args.batch_size, args.seq_len, args.seq_len // 4, 32000)
    batch = collate(seqs, tokenizer.pad_token_id).to(device)
    model.eval()
    if device.type == "cuda":  # the model as loaded, then what the step adds (a built-in model is built in bf16)
        torch.cuda.reset_peak_memory_stats()
    sampler = RssSampler()
    sampler.start()
    with torch.no_grad():
        if mode == "nf4_mezo_step":
            report = attach(model, None, r=8, alpha=16)
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            MeZO(params, 1e-6, 1e-3, dual_modules=report.modules).step(TrainingLoss(model), batch, 1e-6)
        else:
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else sampler.stop()
    return {"mode": mode, "peak_mb": round(peak - before, 1), "weights_mb": round(_weight_bytes(model) / 2**20, 1)}


def _weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers as stored (4-bit weights packed, with their quantisation
    constants)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for m in model.modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            if state.state2 is not None:
                total += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--worker", choices=MODES)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args, args.worker)))
        return
    flags = sys.argv[1:]
    rows = {}
    for mode in MODES:
        # a fixed mmap threshold: glibc otherwise raises it after the bf16 build's large frees, and the freed
        # memory stays in the heap, counted in RSS, instead of going back to the system
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run([sys.executable, __file__, *flags, "--worker", mode], capture_output=True, text=True,
                              check=True, env=env)
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    base, bf16 = rows["nf4_inference"]["peak_mb"], rows["bf16_inference"]["peak_mb"]
    print("| mode | weights MiB | peak MiB | vs 4-bit inference | vs bf16 inference |\n|---|---|---|---|---|")
    for mode, row in rows.items():
        peak = row["peak_mb"]
        print(f"| {mode} | {row['weights_mb']:,.1f} | {peak:,.1f} | {peak / base:.2f}x | {peak / bf16:.2f}x |")


if __name__ == "__main__":
    main()
