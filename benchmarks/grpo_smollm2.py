"""GRPO on a real model: SmolLM2-135M-Instruct on two-digit addition, held-out greedy pass@1 before and after,
on the task, questions and sampling of `benchmarks/rft_smollm2.py` (so the two compare at an equal sample budget).

"What is a + b? Reply with the number only." (a, b in 10..99; the same seeded training and held-out questions as
the RFT benchmark), the reward 1 when the reply's last number is the sum (`regex:`, the RFT verifier), G = 8
completions of at most 32 tokens at temperature 0.7, LoRA r=8 on q/v, loss dapo, beta 0, 4 prompts a step: 50 steps
sample 1,600 completions, one RFT round's worth. Variants: `--importance_sampling_level sequence` (GSPO; with one
optimizer step per generation batch every importance ratio is 1 and its gradient is GRPO's, so compare the two with
`--steps_per_generation 4 --max_steps 200`: the same completions, each batch in 4 optimizer steps),
`--lora_target_modules all-linear` (grpo's own default), and `--sft_steps N` (SFT on the training questions' answers first, then GRPO
continues that adapter; with `--beta` its KL reference is the SFT adapter). Each run checkpoints every 10 steps and
a rerun resumes it (`--resume_from_checkpoint latest`); a row is appended to OUT/table.md as each run lands. The
seed's questions are written into OUT, so run one process per OUT.

    python benchmarks/grpo_smollm2.py --out bench-grpo --trainer regular --seeds 0 1 2
    python benchmarks/grpo_smollm2.py --out bench-gspo --importance_sampling_level sequence --steps_per_generation 4 \
        --max_steps 200 --seeds 0 1 2
    python benchmarks/grpo_smollm2.py --out bench-gspo-paper --importance_sampling_level sequence --loss_type grpo \
        --epsilon 3e-4 --epsilon_high 4e-4 --steps_per_generation 4 --max_steps 200 --seeds 0 1 2   # GSPO's own clip
    python benchmarks/grpo_smollm2.py --out bench-sft-grpo --sft_steps 10 --beta 0.04 --seeds 0 1 2
    python benchmarks/grpo_smollm2.py --out bench-es --trainer zo --zo_objective reward --zo_estimator es \
        --zo_queries 4 --zo_eps 5e-2 --learning_rate 2.5e-2 --temperature 0 --num_generations 1 --prompts_per_step 8 \
        --max_steps 100 --lora_r 1 --seeds 0 1 2   # evolution strategies on greedy answers' rewards, LoRA r=1 on q/v
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rft_smollm2 import LAST_NUMBER, prepare, write_chat_turns, write_questions

from xgblora.checkpoint import step_checkpoints
from xgblora.config import Config, GRPOConfig
from xgblora.recipes import sft
from xgblora.recipes.grpo import run_grpo


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-grpo-smollm2")
    parser.add_argument("--trainer", choices=("regular", "zo"), default="regular")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--max_steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--steps_per_generation", type=int, default=1,
                        help="optimizer steps per generation batch (off-policy past the first: GSPO's case)")
    parser.add_argument("--prompts_per_step", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--importance_sampling_level", choices=("token", "sequence"), default="token")
    parser.add_argument("--loss_type", default="dapo")
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--epsilon_high", type=float, default=None)
    parser.add_argument("--lora_target_modules", default="q_proj,v_proj", help="all-linear: grpo's own default")
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--zo_estimator", default="mezo", help="--trainer zo: mezo, nspsa, fzoo, es")
    parser.add_argument("--zo_queries", type=int, default=None, help="--trainer zo: perturbations per step")
    parser.add_argument("--zo_objective", choices=("loss", "reward"), default="loss",
                        help="--trainer zo: GRPO's loss, or each perturbed policy's own reward (evolution strategies)")
    parser.add_argument("--zo_eps", type=float, default=1e-3, help="--trainer zo: the perturbation scale")
    parser.add_argument("--zo_es_sampling", choices=("antithetic", "independent"), default="antithetic",
                        help="--zo_estimator es: antithetic pairs or independent one-sided members")
    parser.add_argument("--zo_member_batch", type=int, default=1,
                        help="--zo_estimator es on the reward: members sampled in one batched generation")
    parser.add_argument("--lr_scheduler_type", choices=("constant", "linear", "cosine"), default="constant")
    parser.add_argument("--num_generations", type=int, default=8, help="completions per prompt, G")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy, G = 1)")
    parser.add_argument("--sft_steps", type=int, default=0, help="SFT steps (batch 8, lr 1e-3) before GRPO")
    parser.add_argument("--device", default="auto")
    return parser.parse_args()


def resume(folder: Path) -> str | None:
    """'latest' where an earlier run of this folder left checkpoints or finished (a rerun picks it up)."""
    return "latest" if (folder / "results.json").exists() or step_checkpoints(folder / "checkpoints") else None


def sft_adapter(args: argparse.Namespace, model: str, train_file: Path, seed: int, out: Path) -> str:
    """A LoRA adapter from --sft_steps of SFT on the training questions' answers, as chat turns."""
    chat = write_chat_turns(train_file, out / f"sft-seed{seed}.jsonl")
    folder = out / f"sft-seed{seed}"
    if not (folder / "results.json").exists():
        sft.run(Config(model_name=model, task_name="custom", train_file=str(chat), method="lora",
                         lora_target_modules=args.lora_target_modules, max_steps=args.sft_steps,
                         per_device_train_batch_size=8, learning_rate=1e-3, seed=seed, no_eval=True,
                         save_strategy="no", device=args.device, output_dir=str(folder), overwrite_output_dir=True))
    return str(folder / "final")


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    model, table = prepare(out, "| seed | trainer | lr | steps | steps per generation | beta | IS level | loss | "
                                "epsilon | targets | SFT steps | pass@1 before | pass@1 after | KL at step 1 | train s |")
    for seed in args.seeds:
        train_file, heldout = write_questions(out, args.questions, args.heldout, seed)
        adapter = sft_adapter(args, model, train_file, seed, out) if args.sft_steps else None
        folder = out / f"grpo-{args.trainer}-lr{args.learning_rate:g}-seed{seed}"
        cfg = GRPOConfig(model_name=model, adapter=adapter, train_file=str(train_file), eval_file=str(heldout),
                         columns="prompt=question,completion=answer", reward_funcs=[LAST_NUMBER], raw_prompts=False,
                         num_return_sequences=args.num_generations, temperature=args.temperature,
                         max_new_tokens=args.max_new_tokens,
                         per_device_train_batch_size=args.num_generations * args.prompts_per_step
                         // args.steps_per_generation,
                         steps_per_generation=args.steps_per_generation, max_steps=args.max_steps,
                         method="lora", lora_r=args.lora_r, lora_target_modules=args.lora_target_modules,
                         trainer=args.trainer, zo_estimator=args.zo_estimator, zo_queries=args.zo_queries,
                         zo_objective=args.zo_objective, zo_eps=args.zo_eps,
                         zo_es_sampling=args.zo_es_sampling, zo_member_batch=args.zo_member_batch,
                         lr_scheduler_type=args.lr_scheduler_type,
                         learning_rate=args.learning_rate, beta=args.beta,
                         importance_sampling_level=args.importance_sampling_level, policy_loss=args.loss_type,
                         epsilon=args.epsilon, epsilon_high=args.epsilon_high, save_strategy="steps",
                         save_steps=10, save_total_limit=1, logging_steps=1, seed=seed, device=args.device,
                         resume_from_checkpoint=resume(folder), output_dir=str(folder))
        done = run_grpo(cfg)
        first = next(row for line in (folder / "metrics.jsonl").open(encoding="utf-8")
                     if (row := json.loads(line)).get("step") == 1 and "loss" in row)
        trainer = args.trainer if args.trainer == "regular" else \
            f"zo: {args.zo_estimator} x{args.zo_queries or 1} on the {args.zo_objective}, eps {args.zo_eps:g}"
        if args.trainer == "zo" and args.zo_estimator == "es":
            trainer += f", {args.zo_es_sampling}"
        row = (f"| {seed} | {trainer} | {args.learning_rate:g} {args.lr_scheduler_type} | {done['steps']} | {args.steps_per_generation} | "
               f"{args.beta:g} | {args.importance_sampling_level} | {args.loss_type} | "
               f"{args.epsilon:g}/{args.epsilon if args.epsilon_high is None else args.epsilon_high:g} | "
               f"{args.lora_target_modules} r{args.lora_r} | {args.sft_steps} | "
               f"{done['before_eval_pass@1']:.3f} | {done['eval_pass@1']:.3f} | {first.get('kl', 0.0):.2g} | "
               f"{done['train_runtime_s']:.0f} |\n")
        print(json.dumps(done), flush=True)
        with table.open("a", encoding="utf-8") as f:
            f.write(row)


if __name__ == "__main__":
    main()
