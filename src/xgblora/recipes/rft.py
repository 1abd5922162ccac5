"""`xgblora rft`: rejection-sampling fine-tuning in rounds of sample -> verify -> train -> evaluate.

Each round samples N completions of every training question from the current model (or from --sampler_model),
keeps the correct ones (evaluation/answers.py: completions cut off by max_new_tokens dropped, calculator
annotations checked, one per equation list, as OFA-Sys/gsm8k-ScRel's collect_rejection_sampling.py does),
fine-tunes the current model on them (or, with --restart_from_base, the starting model: STaR, ReST-EM) with the
run's method and trainer (LoRA, XGBLoRA or full; AdamW or MeZO), merges the result, and measures pass@1 (greedy)
and pass@k (the unbiased estimator from n >= k samples) on the held-out questions. The next round samples from
that merged model. Round 0 is the starting model, measured only. A 4-bit run (--load_in_4bit) merges each round's
adapter into the full-precision weights it dequantised and quantises the merged model again when the next round
loads it.

OUTPUT_ROOT/
  heldout.jsonl           the held-out questions as SFT rows (each training run's --eval_file)
  round-0/eval.json       the starting model's pass@1 and pass@k
  round-N/samples.jsonl   the training questions with their completions (`xgblora generate`'s format)
  round-N/hinted.jsonl    --rationalize: the unsolved questions' completions with the reference answer as a hint
  round-N/verified.jsonl  per question: samples drawn, truncated (hit max_new_tokens: never kept), correct,
                          equations_wrong, kept (distinct), rationalized, gold
  round-N/train.jsonl     the kept completions as SFT rows: messages when the prompt went through a chat
                          template, else prompt/completion
  round-N/run/            the training run (`xgblora train`'s output folder)
  round-N/model/          the trained model, merged
  round-N/eval-*.jsonl, round-N/eval.json
  rounds.json, rft.png, report.html
A step whose output exists is not run again, sampling resumes part-way and training from its last checkpoint, so
the same command continues an interrupted run.

Each question samples from a seed of its own, named by the run's --seed, the file its completions go to (the round
and what is sampled) and its index in its file, so its completions do not depend on which batch or process samples
it. Under torchrun every process samples its share of the questions (every N-th) and gets everyone's completions,
trains data-parallel (`xgblora train`'s loop), and samples and evaluates again from the merged model; the main
process alone writes files. N processes keep the rows that one process keeps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xgblora import atomic, checkpoint, distributed, outputs, usercode
from xgblora.adapters.trained import load_with_options, resolve
from xgblora.config import Config, RFTConfig, carried_over
from xgblora.data import formats
from xgblora.data.sources import parse_columns, read_rows
from xgblora.data.tasks import Example, PromptTask
from xgblora.distributed import LOCAL, Distributed
from xgblora.errors import UserError
from xgblora.evaluation.answers import MathVerifier, Verifier, equations_hold, keep_correct, make_verifier
from xgblora.export import export_run
from xgblora.generation.generate import Prompts, read_prompts, sampling_params, write_completions
from xgblora.models.sampler import SamplingParams, stream_seed
from xgblora.recipes.sft import run
from xgblora.report import write_rft_report

log = logging.getLogger("xgblora")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return atomic.jsonl_rows(path.read_text(encoding="utf-8"))


@dataclass
class Questions:
    """The questions of a file rendered for one tokenizer, the conversation each prompt stood for (none when the
    prompt was sent as it is), and each one's index in its file (what its sampling seed is named by)."""

    source: str
    prompts: Prompts
    turns: list[list[tuple[str, str]]]
    numbers: list[int]


def read_questions(cfg: RFTConfig, source: str, tokenizer: Any) -> Questions:
    """The questions of a file, rendered for the tokenizer; every one needs a reference answer."""
    prompts = read_prompts(source, tokenizer, columns=cfg.columns, raw=cfg.raw_prompts, max_length=cfg.max_length)
    _check_references(prompts.examples)
    return Questions(source, prompts, [formats.prompt_turns(tokenizer, ex, raw=cfg.raw_prompts)
                                       for ex in prompts.examples], list(range(len(prompts.ids))))


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


def load_round_model(cfg: RFTConfig, path: str, adapter: str | None = None) -> LoadedModel:
    """A model for sampling (with an adapter applied), with --chat_template applied to its tokenizer."""
    model, tokenizer = load_with_options(cfg, path, adapter, cfg.chat_template)
    return LoadedModel(path, model, tokenizer)


def _exists(path: Path, dist: Distributed) -> bool:
    """Whether a step's output exists as the main process sees it, so every process takes the same path (a late
    one would otherwise find what the main one has just written, and skip the collectives it waits in)."""
    return dist.gather_objects(path.exists())[0]


def sample_questions(loaded: LoadedModel, questions: Questions, params: SamplingParams, out: Path,
                     dist: Distributed = LOCAL) -> list[dict[str, Any]]:
    """Each question's row of completions and finish reasons (sampled into `out`, or read back when it exists),
    each question from its own seed (the module docstring)."""
    if _exists(out, dist):
        return _read_jsonl(out)
    settings = {"model": loaded.path, "input": questions.source, **dataclasses.asdict(params)}
    seeds = [stream_seed(params.seed, out.parent.name, out.name, i) for i in questions.numbers]
    if dist.world_size == 1:
        write_completions(loaded.model, loaded.tokenizer, questions.prompts, params, out, settings, seeds=seeds)
        return _read_jsonl(out)
    # this process's share goes to a file of its own, which resumes as `out` would
    mine = range(dist.rank, len(seeds), dist.world_size)
    part = out.with_name(f"{out.stem}.rank-{dist.rank}-of-{dist.world_size}{out.suffix}")
    if not part.exists():
        prompts = questions.prompts
        share = Prompts([prompts.rows[i] for i in mine], [prompts.examples[i] for i in mine],
                        [prompts.ids[i] for i in mine])
        write_completions(loaded.model, loaded.tokenizer, share, params, part, settings, progress=dist.is_main,
                          seeds=[seeds[i] for i in mine])
    rows: list[dict[str, Any]] = [{}] * len(seeds)
    for rank, rows_of_rank in enumerate(dist.gather_objects(_read_jsonl(part))):
        rows[rank::dist.world_size] = rows_of_rank
    if dist.is_main:
        atomic.write_jsonl(out, rows)
    dist.wait_for_main()  # `out` holds every share before any is removed
    part.unlink()
    return rows


@dataclass
class Kept:
    """The training completions of one question and the counts of how they were chosen."""

    completions: list[str]
    counts: dict[str, int]


def keep_question(cfg: RFTConfig, verifier: Verifier | MathVerifier, row: dict[str, Any], reference: str) -> Kept:
    """The completions of one question to train on: finished (a completion cut off by max_new_tokens would teach
    the model to stop mid-solution), correct, with equations that hold (--check_equations), distinct."""
    texts, reasons = row["completions"], row["finish_reasons"]
    finished = [text for text, reason in zip(texts, reasons, strict=True) if reason != "length"]
    verdicts = verifier.judge(finished, reference)
    holds = [not cfg.check_equations or equations_hold(text) for text in finished]
    kept = keep_correct(finished, [v and h for v, h in zip(verdicts, holds, strict=True)], cfg.keep_per_prompt,
                        cfg.distinct)
    return Kept(kept, {"samples": len(texts), "truncated": len(texts) - len(finished), "correct": sum(verdicts),
                       "equations_wrong": sum(v and not h for v, h in zip(verdicts, holds, strict=True)),
                       "kept": len(kept)})


def verify_round(cfg: RFTConfig, questions: Questions, kept: list[Kept], round_dir: Path,
                 rationalized: dict[int, Kept] | None = None, dist: Distributed = LOCAL) -> dict[str, Any]:
    """Write train.jsonl (each question's reference with --include_gold, its kept completions, its rationalised ones)
    and verified.jsonl; return the counts."""
    train, report = [], []
    for i, (ex, turns, own) in enumerate(zip(questions.prompts.examples, questions.turns, kept, strict=True)):
        hinted = rationalized[i].completions if rationalized and i in rationalized else []
        gold = [ex.answers[0]] if cfg.include_gold else []
        train += [sft_row(turns, ex, text) for text in [*gold, *own.completions, *hinted]]
        report.append({"index": i, **own.counts, "rationalized": len(hinted), "gold": len(gold)})
    if dist.is_main:
        atomic.write_jsonl(round_dir / "verified.jsonl", report)
        atomic.write_jsonl(round_dir / "train.jsonl", train)
    dist.wait_for_main()  # every process trains on train.jsonl
    totals = {key: sum(r[key] for r in report) for key in report[0] if key != "index"} if report else {}
    samples = totals.get("samples", 0)
    return {**totals, "train_rows": len(train), "questions_solved": sum(r["kept"] > 0 for r in report),
            "questions": len(report), "kept_fraction": totals.get("kept", 0) / samples if samples else 0.0}


def keep_all(cfg: RFTConfig, verifier: Verifier | MathVerifier, questions: Questions, rows: list[dict[str, Any]]) -> list[Kept]:
    """What each question keeps of its completions (each completion extracted once)."""
    kept = []
    for ex, row in zip(questions.prompts.examples, rows, strict=True):
        with usercode.row(ex.source):  # a user's verifier that fails names the question
            kept.append(keep_question(cfg, verifier, row, ex.answers[0]))
    return kept


def judge(verifier: Verifier | MathVerifier | MathVerifier, ex: Example, completions: list[str]) -> list[bool]:
    """The verifier's verdicts on completions of one question (a user's verifier that fails names its row)."""
    with usercode.row(ex.source):
        return verifier.judge(completions, ex.answers[0])


def hint_questions(cfg: RFTConfig, questions: Questions, chosen: list[int], verifier: Verifier | MathVerifier,
                   tokenizer: Any) -> Questions:
    """The chosen questions with their reference answer given as a hint (STaR's rationalisation), rendered as the
    questions are; a question in messages form gets the hint in its last user turn."""
    examples = []
    for i in chosen:
        ex = questions.prompts.examples[i]
        hint = f"\n(Hint: the answer is {verifier.reference_answer(ex.answers[0])}.)"
        if ex.messages:
            last = max(k for k, (role, _) in enumerate(ex.messages) if role == "user")
            messages = tuple((role, text + hint if k == last else text) for k, (role, text) in enumerate(ex.messages))
            examples.append(dataclasses.replace(ex, messages=messages))
        else:
            examples.append(dataclasses.replace(ex, prompt=ex.prompt + hint))
    ids = [formats.generation_prompt_ids(tokenizer, ex, raw=cfg.raw_prompts)[-cfg.max_length:] for ex in examples]
    prompts = Prompts([questions.prompts.rows[i] for i in chosen], examples, ids)
    return Questions(questions.source, prompts, [questions.turns[i] for i in chosen], chosen)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a question with c correct of n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021,
    the Codex paper's estimator)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate_model(cfg: RFTConfig, model_path: str, adapter: str | None, verifier: Verifier | MathVerifier,
                   round_dir: Path, dist: Distributed = LOCAL) -> dict[str, float]:
    """pass@1 of greedy answers and pass@k from n samples per held-out question (written to eval.json); no pass@k
    at temperature 0 (every sample would be the greedy one)."""
    if _exists(round_dir / "eval.json", dist):
        return json.loads((round_dir / "eval.json").read_text(encoding="utf-8"))
    loaded = load_round_model(cfg, model_path, adapter)
    questions = read_questions(cfg, cfg.eval_file, loaded.tokenizer)
    examples = questions.prompts.examples
    greedy = dataclasses.replace(sampling_params(cfg), num_samples=1, temperature=0.0)
    rows = sample_questions(loaded, questions, greedy, round_dir / "eval-greedy.jsonl", dist)
    metrics = {"pass@1": sum(any(judge(verifier, ex, row["completions"]))
                             for ex, row in zip(examples, rows, strict=True)) / len(examples)}
    if cfg.pass_k and cfg.temperature > 0:
        params = dataclasses.replace(sampling_params(cfg), num_samples=cfg.pass_n or cfg.pass_k)
        rows = sample_questions(loaded, questions, params, round_dir / "eval-samples.jsonl", dist)
        metrics[f"pass@{cfg.pass_k}"] = sum(
            pass_at_k(len(row["completions"]), sum(judge(verifier, ex, row["completions"])), cfg.pass_k)
            for ex, row in zip(examples, rows, strict=True)) / len(examples)
    if dist.is_main:
        atomic.write_text(round_dir / "eval.json", json.dumps(metrics, indent=2) + "\n")
    return metrics


def training_config(cfg: RFTConfig, model_path: str, adapter: str | None, round_dir: Path, n_rows: int) -> Config:
    """The round's `xgblora train` options: the run's own, on the kept rows, from the current model (and its
    adapter, which training continues)."""
    options = carried_over(cfg, Config)
    options.update(model_name=model_path, adapter=adapter, task_name="custom", train_file=str(round_dir / "train.jsonl"),
                   eval_file=str(Path(cfg.output_root) / "heldout.jsonl"), columns=None, data_format="auto",
                   num_train=n_rows, num_dev=None, no_eval=True, result_file=None,
                   output_dir=str(round_dir / "run"))
    return Config(**options)


def train_round(cfg: RFTConfig, model_path: str, adapter: str | None, round_dir: Path, n_rows: int,
                dist: Distributed = LOCAL) -> str:
    """Fine-tune the current model on the round's kept rows (data-parallel under torchrun) and merge it; returns
    the merged model's folder."""
    merged = round_dir / "model"
    if _exists(merged, dist):
        return str(merged)
    train_cfg = training_config(cfg, model_path, adapter, round_dir, n_rows)
    if not _exists(round_dir / "run" / "results.json", dist):  # an interrupted run resumes from its last checkpoint
        resumable = checkpoint.step_checkpoints(round_dir / "run" / "checkpoints")
        run(dataclasses.replace(train_cfg, resume_from_checkpoint="latest") if resumable else train_cfg)
    if dist.is_main:
        export_run(round_dir / "run", "merged", merged, trust_remote_code=cfg.trust_remote_code)
    dist.wait_for_main()  # every process samples from the merged model next
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


def _holds_rft(root: Path) -> bool:
    """Whether a folder holds an earlier rft's outputs (heldout.jsonl is the first one written)."""
    return (root / "heldout.jsonl").is_file() or any(p.is_dir() for p in root.glob("round-*"))


def run_rft(cfg: RFTConfig) -> dict[str, Any]:
    """Run every round (see the module docstring); returns the per-round records (also rounds.json)."""
    _questions(cfg, cfg.train_file, "train")  # every input is checked before a model loads or a folder is made
    heldout = _questions(cfg, cfg.eval_file, "eval")
    verifier = make_verifier(cfg.verifier, cfg.answer_tolerance)
    resolve(cfg.model_name, cfg.adapter)
    if cfg.sampler_model:
        resolve(cfg.sampler_model)
    outputs.check_folder(Path(cfg.output_root), "--output_root", _holds_rft, "an xgblora rft's")
    dist = distributed.setup(cfg)
    cfg = dataclasses.replace(cfg, device=dist.device or cfg.device)  # this process's GPU samples its share
    with atomic.output_folder(Path(cfg.output_root), "--output_root") as root:
        if dist.is_main:
            _heldout_rows(heldout, root)
        dist.wait_for_main()
        return _rounds(cfg, root, verifier, dist)


def _rounds(cfg: RFTConfig, root: Path, verifier: Verifier | MathVerifier, dist: Distributed) -> dict[str, Any]:
    """Round 0's measurement, then each round of sample -> verify -> train -> evaluate."""
    model_path, adapter = cfg.model_name, cfg.adapter
    records = [{"round": 0, "model": model_path,
                **evaluate_model(cfg, model_path, adapter, verifier, root / "round-0", dist)}]
    for number in range(1, cfg.rounds + 1):
        round_dir = root / f"round-{number}"
        sampler = load_round_model(cfg, cfg.sampler_model) if cfg.sampler_model else load_round_model(cfg, model_path, adapter)
        questions = read_questions(cfg, cfg.train_file, sampler.tokenizer)
        rows = sample_questions(sampler, questions, sampling_params(cfg), round_dir / "samples.jsonl", dist)
        kept = keep_all(cfg, verifier, questions, rows)
        rationalized = {}
        unsolved = [i for i, k in enumerate(kept) if not k.completions]
        if cfg.rationalize and unsolved:  # STaR: sampled again with the answer as a hint, trained on without it
            hints = hint_questions(cfg, questions, unsolved, verifier, sampler.tokenizer)
            hinted = sample_questions(sampler, hints, sampling_params(cfg), round_dir / "hinted.jsonl", dist)
            rationalized = dict(zip(unsolved, keep_all(cfg, verifier, hints, hinted), strict=True))
        counts = verify_round(cfg, questions, kept, round_dir, rationalized, dist)
        start = (cfg.model_name, cfg.adapter) if cfg.restart_from_base else (model_path, adapter)
        if counts["train_rows"]:
            model_path, adapter = train_round(cfg, *start, round_dir, counts["train_rows"], dist), None
            scores = evaluate_model(cfg, model_path, adapter, verifier, round_dir, dist)
        else:  # the model stays as it was; a next round draws other samples from it
            log.warning("rft round %d: none of the %d completions was kept, so nothing was trained; raise "
                        "--num_return_sequences, --temperature or --max_new_tokens, or start from a model "
                        "fine-tuned on the task", number, counts["samples"])
            scores = {k: v for k, v in records[-1].items() if k.startswith("pass@")}
        records.append({"round": number, "model": model_path, "trained_from": start[0], **counts, **scores})
        log.info("rft round %d: kept %d of %d samples (%d cut off by --max_new_tokens); %s", number, counts["kept"],
                 counts["samples"], counts["truncated"],
                 ", ".join(f"{k} {v:.3f}" for k, v in records[-1].items() if k.startswith("pass@")))
    if dist.is_main:
        atomic.write_text(root / "rounds.json", json.dumps(records, indent=2) + "\n")
    report = dist.gather_objects(write_rft_report(records, root) if dist.is_main else None)[0]
    return {"rounds": records, **report}
