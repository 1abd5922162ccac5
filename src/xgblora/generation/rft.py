"""`xgblora rft`: rejection-sampling fine-tuning in rounds of sample -> verify -> train -> evaluate.

Each round samples N completions of every training question from the current model (or from --sampler_model),
keeps the correct ones (verify.py: at most K distinct per question), fine-tunes the current model on them with
the run's method and trainer (LoRA, XGBLoRA or full; AdamW or MeZO), merges the result, and measures pass@1
(greedy) and pass@k on the held-out questions. The next round samples from and trains on that merged model.
Round 0 is the starting model, measured only.

OUTPUT_ROOT/
  heldout.jsonl           the held-out questions as SFT rows (each training run's --eval_file)
  round-0/eval.json       the starting model's pass@1 and pass@k
  round-N/samples.jsonl   the training questions with their completions (`xgblora generate`'s format)
  round-N/verified.jsonl  per question: samples drawn, correct, kept
  round-N/train.jsonl     the kept completions as SFT rows: messages when the prompt went through a chat
                          template, else prompt/completion
  round-N/run/            the training run (`xgblora train`'s output folder)
  round-N/model/          the trained model, merged
  round-N/eval-*.jsonl, round-N/eval.json
  rounds.json, rft.png, report.html
A step whose output exists is not run again, and sampling resumes part-way, so the same command continues an
interrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xgblora import atomic, checkpoint
from xgblora.adapters.trained import load_with_options, resolve
from xgblora.config import Config, RFTConfig
from xgblora.data import formats
from xgblora.data.sources import parse_columns, read_rows
from xgblora.data.tasks import Example, PromptTask
from xgblora.errors import UserError
from xgblora.evaluation.answers import Verifier, keep_correct, make_extractor
from xgblora.export import export_run
from xgblora.generation.generate import Prompts, read_prompts, sampling_params, write_completions
from xgblora.models.sampler import SamplingParams
from xgblora.report import write_rft_report
from xgblora.train import run

log = logging.getLogger("xgblora")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@dataclass
class Questions:
    """The questions of a file rendered for one tokenizer, and the conversation each prompt stood for (none when
    the prompt was sent as it is)."""

    source: str
    prompts: Prompts
    turns: list[list[tuple[str, str]]]


def read_questions(cfg: RFTConfig, source: str, tokenizer: Any) -> Questions:
    """The questions of a file, rendered for the tokenizer; every one needs a reference answer."""
    prompts = read_prompts(source, tokenizer, columns=cfg.columns, raw=cfg.raw_prompts, max_length=cfg.max_length)
    _check_references(prompts.examples)
    return Questions(source, prompts, [formats.prompt_turns(tokenizer, ex, raw=cfg.raw_prompts)
                                       for ex in prompts.examples])


def _check_references(examples: list[Example]) -> None:
    for ex in examples:
        if not ex.answers:
            raise UserError(f"{ex.source}: no reference answer to verify against (a completion, response, or a "
                            f"final assistant turn; --columns completion=answer maps yours)")


def sft_row(turns: list[tuple[str, str]], ex: Example, completion: str) -> dict[str, Any]:
    """A training row of the SFT path: the conversation with the answer as its last turn, or prompt/completion."""
    if turns:
        return {"messages": [{"role": r, "content": c} for r, c in [*turns, ("assistant", completion)]]}
    return {"prompt": ex.prompt, "completion": completion}


@dataclass
class LoadedModel:
    """A model that samples, with its tokenizer, and where it was loaded from (recorded with its samples)."""

    path: str
    model: Any
    tokenizer: Any


def load_model(cfg: RFTConfig, path: str, adapter: str | None = None) -> LoadedModel:
    """A model for sampling (with an adapter applied), with --chat_template applied to its tokenizer."""
    model, tokenizer = load_with_options(cfg, path, adapter, cfg.chat_template)
    return LoadedModel(path, model, tokenizer)


def sample_questions(loaded: LoadedModel, questions: Questions, params: SamplingParams, out: Path) -> list[list[str]]:
    """The completions of every question (sampled into `out`, or read back when it exists)."""
    if not out.exists():
        settings = {"model": loaded.path, "input": questions.source, **dataclasses.asdict(params)}
        write_completions(loaded.model, loaded.tokenizer, questions.prompts, params, out, settings)
    return [row["completions"] for row in _read_jsonl(out)]


def verify_round(cfg: RFTConfig, questions: Questions, completions: list[list[str]], verifier: Verifier,
                 round_dir: Path) -> dict[str, Any]:
    """Keep the correct completions: write train.jsonl and verified.jsonl; return the counts."""
    rows, report = [], []
    for i, (ex, turns, texts) in enumerate(zip(questions.prompts.examples, questions.turns, completions, strict=True)):
        verdicts = verifier.judge(texts, ex.answers[0])
        kept = keep_correct(texts, verdicts, cfg.keep_per_prompt)
        rows += [sft_row(turns, ex, text) for text in kept]
        report.append({"index": i, "samples": len(texts), "correct": sum(verdicts), "kept": len(kept)})
    atomic.write_jsonl(round_dir / "verified.jsonl", report)
    atomic.write_jsonl(round_dir / "train.jsonl", rows)
    samples = sum(r["samples"] for r in report)
    return {"samples": samples, "correct": sum(r["correct"] for r in report), "kept": len(rows),
            "questions_solved": sum(r["kept"] > 0 for r in report), "questions": len(report),
            "kept_fraction": len(rows) / samples if samples else 0.0}


def evaluate_model(cfg: RFTConfig, model_path: str, adapter: str | None, verifier: Verifier,
                   round_dir: Path) -> dict[str, float]:
    """pass@1 of greedy answers and pass@k of k samples per held-out question (written to eval.json)."""
    if (round_dir / "eval.json").exists():
        return json.loads((round_dir / "eval.json").read_text(encoding="utf-8"))
    loaded = load_model(cfg, model_path, adapter)
    questions = read_questions(cfg, cfg.eval_file, loaded.tokenizer)
    greedy = dataclasses.replace(sampling_params(cfg), num_samples=1, temperature=0.0)
    runs = {"pass@1": sample_questions(loaded, questions, greedy, round_dir / "eval-greedy.jsonl")}
    if cfg.pass_k:
        params = dataclasses.replace(sampling_params(cfg), num_samples=cfg.pass_k)
        runs[f"pass@{cfg.pass_k}"] = sample_questions(loaded, questions, params, round_dir / "eval-samples.jsonl")
    examples = questions.prompts.examples
    metrics = {name: sum(any(verifier.judge(texts, ex.answers[0]))
                         for ex, texts in zip(examples, completions, strict=True)) / len(examples)
               for name, completions in runs.items()}
    atomic.write_text(round_dir / "eval.json", json.dumps(metrics, indent=2) + "\n")
    return metrics


def training_config(cfg: RFTConfig, model_path: str, adapter: str | None, round_dir: Path, n_rows: int) -> Config:
    """The round's `xgblora train` options: the run's own, on the kept rows, from the current model (and its
    adapter, which training continues)."""
    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)}
    options.update(model_name=model_path, adapter=adapter, task_name="custom", train_file=str(round_dir / "train.jsonl"),
                   eval_file=str(Path(cfg.output_root) / "heldout.jsonl"), columns=None, data_format="auto",
                   num_train=n_rows, num_dev=None, no_eval=True, result_file=None,
                   output_dir=str(round_dir / "run"))
    return Config(**options)


def train_round(cfg: RFTConfig, model_path: str, adapter: str | None, round_dir: Path, n_rows: int) -> str:
    """Fine-tune the current model on the round's kept rows and merge it; returns the merged model's folder."""
    merged = round_dir / "model"
    if merged.exists():
        return str(merged)
    train_cfg = training_config(cfg, model_path, adapter, round_dir, n_rows)
    if not (round_dir / "run" / "results.json").exists():  # an interrupted run resumes from its last checkpoint
        resumable = (round_dir / "run").is_dir() and checkpoint.step_checkpoints(round_dir / "run")
        run(dataclasses.replace(train_cfg, resume_from_checkpoint="latest") if resumable else train_cfg)
    export_run(round_dir / "run", "merged", merged, trust_remote_code=cfg.trust_remote_code)
    return str(merged)


def _questions(cfg: RFTConfig, source: str, split: str) -> list[Example]:
    """The questions of a file, each with its reference answer (checked before any model loads)."""
    task = PromptTask()
    examples = [ex for where, row in read_rows(source, split, parse_columns(cfg.columns))
                for ex in task.examples(row, where)]
    _check_references(examples)
    return examples


def _heldout_rows(examples: list[Example], root: Path) -> None:
    """heldout.jsonl: the held-out questions and references as SFT rows (each training run's --eval_file)."""
    atomic.write_jsonl(root / "heldout.jsonl", [sft_row(list(ex.messages), ex, ex.answers[0]) for ex in examples])


def run_rft(cfg: RFTConfig) -> dict[str, Any]:
    """Run every round (see the module docstring); returns the per-round records (also rounds.json)."""
    _questions(cfg, cfg.train_file, "train")  # every input is checked before a model loads or a folder is made
    heldout = _questions(cfg, cfg.eval_file, "eval")
    verifier = Verifier(make_extractor(cfg.verifier), cfg.answer_tolerance)
    resolve(cfg.model_name, cfg.adapter)
    if cfg.sampler_model:
        resolve(cfg.sampler_model)
    with atomic.output_folder(Path(cfg.output_root), "--output_root") as root:
        _heldout_rows(heldout, root)
        return _rounds(cfg, root, verifier)


def _rounds(cfg: RFTConfig, root: Path, verifier: Verifier) -> dict[str, Any]:
    """Round 0's measurement, then each round of sample -> verify -> train -> evaluate."""
    model_path, adapter = cfg.model_name, cfg.adapter
    records = [{"round": 0, "model": model_path,
                **evaluate_model(cfg, model_path, adapter, verifier, root / "round-0")}]
    for number in range(1, cfg.rounds + 1):
        round_dir = root / f"round-{number}"
        sampler = load_model(cfg, cfg.sampler_model) if cfg.sampler_model else load_model(cfg, model_path, adapter)
        questions = read_questions(cfg, cfg.train_file, sampler.tokenizer)
        completions = sample_questions(sampler, questions, sampling_params(cfg), round_dir / "samples.jsonl")
        counts = verify_round(cfg, questions, completions, verifier, round_dir)
        if counts["kept"]:
            model_path, adapter = train_round(cfg, model_path, adapter, round_dir, counts["kept"]), None
            scores = evaluate_model(cfg, model_path, adapter, verifier, round_dir)
        else:  # the model stays as it was; a next round draws other samples from it
            log.warning("rft round %d: none of the %d completions was correct, so nothing was trained; raise "
                        "--num_return_sequences or --temperature, or start from a model fine-tuned on the task",
                        number, counts["samples"])
            scores = {k: v for k, v in records[-1].items() if k.startswith("pass@")}
        records.append({"round": number, "model": model_path, **counts, **scores})
        log.info("rft round %d: kept %d of %d samples; %s", number, counts["kept"], counts["samples"],
                 ", ".join(f"{k} {v:.3f}" for k, v in records[-1].items() if k.startswith("pass@")))
    atomic.write_text(root / "rounds.json", json.dumps(records, indent=2) + "\n")
    return {"rounds": records, **write_rft_report(records, root)}
