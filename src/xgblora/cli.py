"""The `xgblora` command: one subcommand per workflow (COMMANDS), each importing its module when it runs."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xgblora import atomic, parsing
from xgblora import config as config_mod
from xgblora import options as opts
from xgblora.bench.flags import add_arguments as add_bench_arguments
from xgblora.errors import RankLostError, UserError

# Per-command defaults that differ from the dataclass's. MeZO's run.py evaluates zero-shot unless given --trainer
# and --num_train k, and copies its results to result/<tag>.json; `xgblora mezo` keeps that for its command lines.
EVAL_DEFAULTS = {"num_train": 0, "trainer": "none"}
MEZO_DEFAULTS = {"num_train": 0, "trainer": "none", "result_file": "auto"}
# RFT samples 8 answers per question at temperature 0.7 (the seed workflow's oversampling, a little below it) and
# trains LoRA adapters on the user's own data.
RFT_DEFAULTS = {"task_name": "custom", "method": "lora", "learning_rate": 2e-4, "num_return_sequences": 8,
                "temperature": 0.7, "max_new_tokens": 256}
# GRPO trains a LoRA adapter by default, at a learning rate for adapters (TRL's 1e-6 is for full fine-tuning).
GRPO_DEFAULTS = {"task_name": "custom", "method": "lora", "learning_rate": 1e-5}
# DPO trains a LoRA adapter by default, at a learning rate for adapters (TRL's 1e-6 is for full fine-tuning), on
# TRL's max_length of 1024 tokens.
DPO_DEFAULTS = {"task_name": "custom", "method": "lora", "learning_rate": 1e-5, "max_length": 1024}
# KTO too (TRL's KTOConfig has DPOConfig's learning rate and max_length).
KTO_DEFAULTS = DPO_DEFAULTS
# A reward model trains a LoRA adapter and its new score head by default, at TRL's RewardConfig learning rate and
# max_length.
REWARD_DEFAULTS = {"task_name": "custom", "method": "lora", "learning_rate": 1e-4, "max_length": 1024}



def _options(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Any:
    """The command's options from its flags (and --config), checked before the heavy imports. Given --adapter and
    no --model_name, the base is the one the adapter was trained on, not the command's default model."""
    command = COMMANDS[args.command]
    defaults = command.defaults if defaults is None else defaults
    cfg = parsing.from_namespace(command.options, args, defaults, command.reads)
    if getattr(cfg, "adapter", None):
        from xgblora.adapters.trained import recorded_base

        base = recorded_base(cfg.adapter)
        if base is not None and base != cfg.model_name:  # the command line and --config still win
            cfg = parsing.from_namespace(command.options, args, {**defaults, "model_name": base}, command.reads)
    return cfg


def _train(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.recipes.sft import run

    print(json.dumps(run(cfg), indent=2))
    return 0


def _eval(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.adapters.trained import run_options
    from xgblora.models.pretrained import sentence_settings
    from xgblora.recipes.sft import run

    trained = run_options(cfg.model_name, cfg.adapter)  # a trained run is scored on its own task, as it was trained
    if not trained and cfg.retrieval_files is not None:  # a sentence-transformers model embeds as it says
        trained = sentence_settings(cfg.model_name)
    if trained:
        cfg = _options(args, {**EVAL_DEFAULTS, **trained})
    print(json.dumps(run(cfg), indent=2))
    return 0


def _mezo(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.recipes.sft import run

    print(json.dumps(run(cfg), indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.generation.generate import generate_file

    print(json.dumps(generate_file(cfg), indent=2))
    return 0


def _chat(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.generation.chat import chat

    return chat(cfg)


def _rft(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.recipes.rft import run_rft

    done = run_rft(cfg)
    print(json.dumps(done["rounds"], indent=2))
    print(f"report: {done['html']}  figure: {done['figure']}")
    return 0


def _grpo(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.recipes.grpo import run_grpo

    print(json.dumps(run_grpo(cfg), indent=2))
    return 0


def _dpo(args: argparse.Namespace) -> int:
    from xgblora.recipes.dpo import run_dpo

    print(json.dumps(run_dpo(_options(args)), indent=2))
    return 0


def _kto(args: argparse.Namespace) -> int:
    from xgblora.recipes.kto import run_kto

    print(json.dumps(run_kto(_options(args)), indent=2))
    return 0


def _reward(args: argparse.Namespace) -> int:
    from xgblora.recipes.reward import run_reward

    print(json.dumps(run_reward(_options(args)), indent=2))
    return 0


def _compare(args: argparse.Namespace) -> int:
    cfg = _options(args)
    from xgblora.compare import compare

    done = compare(cfg)
    print(done["summary"])
    print(f"report: {done['html']}  figure: {done['loss_figure']}")
    for name, message in done["failed"]:
        print(f"FAILED {name}: {message}", file=sys.stderr)
    return 1 if done["failed"] else 0


def _demo(args: argparse.Namespace) -> int:
    atomic.check_path(args.output_root, "--output_root")
    from xgblora.demo import run_demo

    done = run_demo(Path(args.output_root), steps=args.steps)
    print(f"untrained tiny-opt: accuracy {done['untrained_accuracy']:.3f}")
    print(done["summary"])
    print(f"report: {done['html']}  (also report.md, {done['loss_figure']})")
    return 1 if done["failed"] else 0


def _export(args: argparse.Namespace) -> int:
    from xgblora.export import FORMATS, export_run

    chosen = FORMATS[args.format]
    options = {name: getattr(args, name) for f in FORMATS.values() for name in (f.output, *f.options)}
    for flag, value in (("--output_dir", args.output_dir), ("--output_file", args.output_file),
                        ("--ollama_modelfile", args.ollama_modelfile)):
        atomic.check_path(value, flag)
    result = export_run(Path(args.run_dir), args.format, options.pop(chosen.output), args.checkpoint,
                        args.trust_remote_code, **options)
    print(json.dumps(result, indent=2))
    return 0


def _encode(args: argparse.Namespace) -> int:
    from xgblora.embeddings.encode import EncodeOptions, encode_file

    options = {k: v for k, v in vars(args).items() if k != "command"}
    print(json.dumps(encode_file(EncodeOptions(**options)), indent=2))
    return 0


def _mine(args: argparse.Namespace) -> int:
    from xgblora.embeddings.mine import MineOptions, mine_file

    options = {k: v for k, v in vars(args).items() if k != "command"}
    print(json.dumps(mine_file(MineOptions(**options)), indent=2))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from xgblora.bench.suites import main as bench_main

    return bench_main(args)


def _env(args: argparse.Namespace) -> int:  # noqa: ARG001
    from xgblora.env import environment

    print(json.dumps(environment(), indent=2))
    return 0


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block of every flag), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless the help already says what it is or the flag is a switch."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-command per entry of COMMANDS."""
    parser = _Parser(prog="xgblora", description="Fast, memory-lean fine-tuning: XGBLoRA, LoRA, full FT; "
                                                 "AdamW or MeZO.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help, allow_abbrev=False,
                           formatter_class=_Help)
        if command.options is not None:
            parsing.add_arguments(p, command.options, command.defaults, command.groups)
        elif command.add_flags is not None:
            command.add_flags(p)
    return parser


def _add_export_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("run_dir", help="A run's --output_dir (holds config.yaml, and final/ once finished).")
        p.add_argument("--checkpoint", default=None, metavar="step-N|latest|best",
                       help="Export this checkpoint instead of final/ (an interrupted run's too; latest: the "
                            "newest intact one).")
        p.add_argument("--format", choices=("peft", "merged", "gguf"), default="peft",
                       help="peft: a PEFT LoRA adapter; merged: the full model with every delta merged; gguf: "
                            "the merged model as one GGUF file (llama.cpp, Ollama, LM Studio).")
        p.add_argument("--rank", type=int, default=None,
                       help="peft only: compress each module's summed delta to this rank by truncated SVD.")
        p.add_argument("--output_dir", "--output-dir", "--out", dest="output_dir", default=None,
                       help="peft, merged: the folder to write (new, or empty).")
        p.add_argument("--output_file", "--output-file", dest="output_file", default=None,
                       help="gguf: the file to write (never over an existing one).")
        p.add_argument("--quantization", default=None, metavar="f16|bf16|f32|q8_0|q5_1|q5_0|q4_1|q4_0",
                       help="gguf: the weights' type (default: a GGUF-trained run's own type, else f16).")
        p.add_argument("--ollama_modelfile", "--ollama-modelfile", default=None, metavar="FILE",
                       help="gguf: also write an Ollama Modelfile (FROM, TEMPLATE, SYSTEM, stop tokens).")
        p.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                       help="merged: let the base model run its own code (only when you pass it).")


def _add_demo_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--output_root", "--output-root", default="xgblora-demo", help="Where the report goes.")
        p.add_argument("--steps", type=int, default=300, help="AdamW steps per run (MeZO runs take 5x as many).")


def _add_encode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="A trained run's folder (config.yaml, final/), a merged export, or any model "
                                 "--model_name takes (folder, pkg:, hub id).")
    p.add_argument("--input_file", "--input-file", "--input", dest="input_file", required=True,
                   help="The texts: JSONL, CSV/TSV, parquet, arrow, a save_to_disk folder or a dataset id.")
    p.add_argument("--output_file", "--output-file", "--output", dest="output_file", required=True,
                   help="Where to write the embeddings: FILE.npy or FILE.safetensors (tensor 'embeddings'); never "
                        "over an existing file.")
    p.add_argument("--column", default="text", help="The field holding the text.")
    p.add_argument("--role", choices=("query", "document"), default="query",
                   help="A run's instruction prefix to put first: its --query_instruction or --doc_instruction.")
    p.add_argument("--prefix", default=None, help="Text put before every input (wins over --role).")
    p.add_argument("--pooling", choices=("mean", "cls", "last"), default=None,
                   help="Default: the run's, or the model's sentence-transformers pooling, else mean (last for causal LMs).")
    p.add_argument("--max_length", "--max-length", type=int, default=None,
                   help="Tokens per input (default: the run's, or the model's max_seq_length, else 512).")
    p.add_argument("--bidirectional", type=parsing.parse_bool, default=None, metavar="BOOL",
                   help="A causal LM attends both ways (default: as the run was trained).")
    p.add_argument("--batch_size", "--batch-size", type=int, default=32, help="Texts per forward.")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available).")
    p.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                   help="Let the model run its own code (only when you pass it).")


def _add_mine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="The embedding model that ranks the documents: a trained run's folder, a merged "
                                 "export, or any model --model_name takes (folder, pkg:, hub id).")
    p.add_argument("--input_file", "--input-file", "--input", dest="input_file", required=True,
                   help="Pair rows (query, positive), in any form --train_file takes.")
    p.add_argument("--output_file", "--output-file", "--output", dest="output_file", required=True,
                   help="The .jsonl to write (query, positive, negatives); never over an existing file.")
    p.add_argument("--columns", default=None, help="Your column names, as in train: query=question,positive=passage.")
    p.add_argument("--corpus", default=None, help="More documents to draw negatives from (a file or dataset id).")
    p.add_argument("--corpus_column", "--corpus-column", default="text", help="The --corpus field holding the text.")
    p.add_argument("--num_negatives", "--num-negatives", type=int, default=1,
                   help="Negatives per row, at most --range_max - --range_min (default 1); a row gets fewer where "
                        "the corpus or the filters leave fewer (the printed rows_short_of_num_negatives counts them).")
    p.add_argument("--range_min", "--range-min", type=int, default=0,
                   help="Skip this many of the most similar documents left after the margins and score bounds "
                        "(likely unlabelled positives), as mine_hard_negatives counts them.")
    p.add_argument("--range_max", "--range-max", type=int, default=50,
                   help="Draw negatives from the range_max most similar documents that are not a positive.")
    p.add_argument("--absolute_margin", "--absolute-margin", type=float, default=None,
                   help="Drop documents scoring above the positive's cosine minus this, 0 to 2 (cosines lie in "
                        "[-1, 1]; 0: only documents above the positive).")
    p.add_argument("--relative_margin", "--relative-margin", type=float, default=0.05,
                   help="Drop documents scoring above the positive's cosine minus |that cosine| x this, 0 or more "
                        "(default 0.05; 0: only documents above the positive; 1: for a positive cosine, every "
                        "document above 0).")
    p.add_argument("--max_score", "--max-score", type=float, default=None,
                   help="Drop documents whose cosine with the query is above this (at least --min_score).")
    p.add_argument("--min_score", "--min-score", type=float, default=None,
                   help="Drop documents whose cosine with the query is below this.")
    p.add_argument("--sampling", choices=("top", "random"), default="top",
                   help="top: the most similar documents left; random: a seeded draw of them.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_length", "--max-length", type=int, default=None,
                   help="Tokens per text (default: the run's, or the model's max_seq_length, else 512).")
    p.add_argument("--batch_size", "--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true")


@dataclass(frozen=True)
class Command:
    """A sub-command: its one-line help, the function that runs it, and its flags: an options dataclass with the
    groups of it the command reads (options.GROUPS; its own classes' fields come too) and the defaults that differ
    from the dataclass's, or a function that adds them."""

    help: str
    run: Callable[[argparse.Namespace], int]
    options: type | None = None
    groups: tuple[type, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    add_flags: Callable[[argparse.ArgumentParser], None] | None = None

    @property
    def reads(self) -> frozenset[str] | None:
        """The options the command reads (None: it takes no options class)."""
        return config_mod.command_options(self.options, self.groups) if self.options is not None else None


# What every trainer reads (the model, its rows, the method and optimiser, the loop), and what training on a task's
# examples adds (MeZO's tasks and custom data: heads, embeddings, instruction SFT, batching).
TRAINING = (opts.ModelOptions, opts.InputOptions, opts.AdapterOptions, opts.BoostingOptions, opts.OptimizerOptions,
            opts.ZOOptions, opts.ComputeOptions, opts.LoopOptions)
TASK_TRAINING = (*TRAINING, opts.TaskOptions, opts.HeadOptions, opts.EmbeddingOptions, opts.SupervisedOptions,
                 opts.ContrastiveOptions, opts.RerankOptions, opts.InstructionOptions, opts.BatchOptions)
EVALUATION = (opts.ModelOptions, opts.InputOptions, opts.TaskOptions, opts.HeadOptions, opts.EmbeddingOptions,
              opts.RetrievalOptions, opts.RerankEvalOptions, opts.ComputeOptions, opts.RunOptions, opts.OutputOptions,
              opts.ResultFileOptions)
RUN_FOLDER = (opts.RunOptions, opts.OutputOptions)

COMMANDS: dict[str, Command] = {
    "train": Command("Fine-tune a model (ft, lora or xgblora) with AdamW (--trainer regular) or MeZO (--trainer zo).",
                     _train, config_mod.Config, (*TASK_TRAINING, *RUN_FOLDER, opts.ResultFileOptions)),
    "compare": Command("Run XGBLoRA and LoRA (or any methods) side by side over seeds; write a loss figure and tables.",
                       _compare, config_mod.CompareConfig, TASK_TRAINING),
    "eval": Command("Zero-shot or in-context evaluation (k demonstrations with --num_train k), or retrieval on BEIR files (--beir_dir); writes results.json.",
                    _eval, config_mod.Config, EVALUATION, EVAL_DEFAULTS),
    "mezo": Command("MeZO's run.py as it is: its flags and defaults (no training unless --trainer; result/ copy).",
                    _mezo, config_mod.Config, (*TASK_TRAINING, *RUN_FOLDER, opts.ResultFileOptions), MEZO_DEFAULTS),
    "generate": Command("Sample completions of every prompt in a file (N per prompt, greedy or sampled); JSONL out, resumable.",
                        _generate, config_mod.GenerateConfig, (opts.ModelOptions, opts.SamplingOptions)),
    "chat": Command("Talk to a model in the terminal: streamed replies, multi-turn through the chat template.",
                    _chat, config_mod.ChatConfig, (opts.ModelOptions, opts.SamplingOptions)),
    "rft": Command("Rejection-sampling fine-tuning: rounds of sample -> verify -> train -> evaluate (pass@1, pass@k).",
                   _rft, config_mod.RFTConfig, (*TRAINING, opts.InstructionOptions, opts.BatchOptions,
                                                opts.RunOptions, opts.SamplingOptions), RFT_DEFAULTS),
    "grpo": Command("Online RL with verifiable rewards (GRPO or RLOO, TRL's options): sample G answers per prompt, reward, update.",
                    _grpo, config_mod.GRPOConfig, (*TRAINING, *RUN_FOLDER, opts.SamplingOptions, opts.RLOOOptions),
                    GRPO_DEFAULTS),
    "dpo": Command("Preference training on chosen/rejected pairs (DPO, IPO, hinge, robust, SimPO, ORPO; TRL's options).",
                   _dpo, config_mod.DPOConfig, (*TRAINING, *RUN_FOLDER, opts.BatchOptions), DPO_DEFAULTS),
    "kto": Command("Preference training on unpaired rows: a completion and whether it is desirable (KTO; TRL's options).",
                   _kto, config_mod.KTOConfig, (*TRAINING, *RUN_FOLDER, opts.BatchOptions, opts.KTOOptions),
                   KTO_DEFAULTS),
    "reward": Command("Train a reward model (a sequence classifier with one score) on chosen/rejected pairs, as TRL's RewardTrainer.",
                      _reward, config_mod.RewardConfig, (*TRAINING, *RUN_FOLDER, opts.BatchOptions, opts.RewardOptions),
                      REWARD_DEFAULTS),
    "bench": Command("Measure speed and memory against baselines.", _bench, add_flags=add_bench_arguments),
    "env": Command("Print the environment report (versions, device, attention backends, chosen defaults).", _env),
    "export": Command("Export a run as a PEFT adapter, a merged model, or a GGUF file (llama.cpp, Ollama).", _export,
                      add_flags=_add_export_arguments),
    "encode": Command("Write the embeddings of one text field of a file (a trained embedding run, or any embedding model).",
                      _encode, add_flags=_add_encode_arguments),
    "mine": Command("Mine hard negatives for a pair file with an embedding model; write a pair file the trainer reads.",
                    _mine, add_flags=_add_mine_arguments),
    "demo": Command("Offline demo: XGBLoRA vs LoRA under AdamW and MeZO on a built-in task, with a report.",
                    _demo, add_flags=_add_demo_arguments),
}


def _unrecognized(command: str, unknown: list[str]) -> UserError:
    """The error for flags the command does not have, suggesting the closest of its options."""
    names = sorted(COMMANDS[command].reads or ())
    flag = next((a for a in unknown if a.startswith("--")), "")
    name = flag[2:].split("=")[0].replace("-", "_")
    elsewhere = [other for other, c in COMMANDS.items() if name in (c.reads or ())]
    close = difflib.get_close_matches(name, names, n=1) if flag else []
    hint = f"; xgblora {command} never reads it (an option of xgblora {', '.join(elsewhere[:3])})" if elsewhere else ""
    hint += f"; did you mean --{close[0]}?" if close else ""
    return UserError(f"unrecognized arguments: {' '.join(unknown)}{hint} (see xgblora {command} --help)")


def plain_warnings() -> None:
    """Warnings as one plain line each ("xgblora: warning: ..."), without the source line Python adds; the
    FutureWarnings transformers and torch raise about their own API renames (a user cannot act on them) are off."""
    warnings.formatwarning = lambda message, category, *rest, **kw: f"xgblora: warning: {message}\n"  # noqa: ARG005
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|transformers)(\.|$)")


def _error_line(text: str) -> None:
    """One write of the line and its newline: print() writes them apart, and under torchrun another process's log
    line can land between them on the shared stderr."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `xgblora` console script; returns the exit code (2 for a user error)."""
    from xgblora.logs import setup_console_logging

    setup_console_logging()
    plain_warnings()
    args, unknown = build_parser().parse_known_args(argv)
    try:
        if unknown:
            raise _unrecognized(args.command, unknown)
        return COMMANDS[args.command].run(args)
    except UserError as exc:
        _error_line(f"xgblora {args.command}: error: {exc}")
        return 2
    except RankLostError as exc:
        _error_line(f"xgblora {args.command}: error: {exc}")
        return 1
    except KeyboardInterrupt as exc:
        _error_line(f"xgblora {args.command}: interrupted" + (f": {exc}" if str(exc) else ""))
        return 130


if __name__ == "__main__":
    sys.exit(main())
