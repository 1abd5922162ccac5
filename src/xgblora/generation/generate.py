"""`xgblora generate`: completions of every prompt in a file, written as JSONL, resumable.

Completions are appended to OUTPUT.partial one batch at a time (each line: a prompt's index and its completions),
with the settings beside it in OUTPUT.partial.json. Started again with the same settings, an interrupted run skips
the prompts already written (a half-written last line is dropped) and, because the sampler is deterministic per
batch, writes what an uninterrupted run would have. When every prompt is done, OUTPUT is written whole in the
input's order (each input row with `completions` and `finish_reasons`) and the partial files are removed. An
existing OUTPUT is never overwritten.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from xgblora import atomic
from xgblora.adapters.trained import load_with_options, resolve
from xgblora.config import GenerateConfig
from xgblora.data import formats
from xgblora.data.sources import parse_columns, read_rows
from xgblora.data.tasks import Example, PromptTask
from xgblora.errors import UserError
from xgblora.models.sampler import Sample, Sampler, SamplingParams


@dataclass
class Prompts:
    """The prompts of a file: each input row, its example (prompt and reference) and its rendered tokens."""

    rows: list[dict[str, Any]]
    examples: list[Example]
    ids: list[list[int]]


def read_prompts(source: str, tokenizer: PreTrainedTokenizerBase, *, columns: str | None = None, raw: bool = False,
                 system: str | None = None, max_length: int = 4096,
                 tools: Sequence[Callable[..., Any]] | None = None) -> Prompts:
    """Read and render the prompts of a file (describing `tools` to the model); prompts longer than max_length keep
    their last tokens (one warning)."""
    rows, examples = read_prompt_rows(source, columns)
    rendered = [formats.generation_prompt_ids(tokenizer, ex, raw=raw, system=system, tools=tools) for ex in examples]
    cut = sum(len(ids) > max_length for ids in rendered)
    if cut:
        warnings.warn(f"{cut} of {len(rendered)} prompts were longer than max_length = {max_length} tokens and keep "
                      f"their last {max_length}", stacklevel=2)
    return Prompts(rows, examples, [ids[-max_length:] for ids in rendered])


def read_prompt_rows(source: str, columns: str | None = None) -> tuple[list[dict[str, Any]], list[Example]]:
    """Each row of a prompts file (with the user's own column names) and its example; checked before any model
    loads, so that a bad file is a one-line error in a second."""
    task, mapping = PromptTask(), parse_columns(columns)
    theirs = {ours: their_name for their_name, ours in mapping.items()}
    rows, examples = [], []
    for where, row in read_rows(source, "train", mapping):
        rows.append({theirs.get(key, key): value for key, value in row.items()})  # the user's own column names
        examples.extend(task.examples(row, where))
    return rows, examples


def sampling_params(cfg: Any, num_samples: int | None = None) -> SamplingParams:
    """The sampler's parameters from a config holding SamplingOptions, max_new_tokens and seed; num_samples per
    prompt, else the config's --num_return_sequences."""
    num_samples = cfg.num_return_sequences if num_samples is None else num_samples
    return SamplingParams(num_samples=num_samples, max_new_tokens=cfg.max_new_tokens,
                          temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                          max_batch_tokens=cfg.max_batch_tokens)


class PartialOutput:
    """OUTPUT.partial and its settings: what an interrupted generation has written, and appending to it."""

    def __init__(self, output: Path, settings: dict[str, Any]):
        self.output = output
        self.partial = output.with_name(output.name + ".partial")
        self.settings_file = output.with_name(output.name + ".partial.json")
        if output.exists():
            raise UserError(f"{output} exists; choose another --output_file (it is never overwritten)")
        if self.partial.exists():
            self._check_settings(settings)
        else:
            text = json.dumps(settings, indent=2, sort_keys=True)
            with atomic.write_errors(self.settings_file, "Free some space and run the command again",
                                     lambda: len(text.encode("utf-8"))):
                atomic.write_text(self.settings_file, text)
        self.lines = self._complete_lines()

    def _check_settings(self, settings: dict[str, Any]) -> None:
        try:
            before = json.loads(self.settings_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise UserError(f"{self.partial} exists without readable settings ({self.settings_file.name}); it was "
                            f"not written by xgblora generate: move it away") from None
        changed = [k for k in sorted(set(before) | set(settings)) if before.get(k) != settings.get(k)]
        if changed:
            k = changed[0]
            raise UserError(f"{self.partial}: an interrupted generation with {k}={before.get(k)!r}, now "
                            f"{settings.get(k)!r}; continue with its settings or remove {self.partial}")

    def _complete_lines(self) -> dict[int, dict[str, Any]]:
        """The lines written whole, by prompt index; a torn last line is cut off the file."""
        if not self.partial.exists():
            return {}
        data = self.partial.read_bytes()
        whole = data[:data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            with open(self.partial, "r+b") as handle:
                handle.truncate(len(whole))
        return {r["index"]: r for r in atomic.jsonl_rows(whole.decode("utf-8"))}

    def append(self, records: list[dict[str, Any]]) -> None:
        """Add one batch's lines durably (one write, then fsync). A failed write (a full disk) ends in one line; what
        it left (whole lines, perhaps a torn last one) is what the next run resumes from."""
        advice = (f"The {len(self.lines)} prompts done are kept: free some space and run the same command again to "
                  f"continue")
        with atomic.write_errors(self.partial, advice), open(self.partial, "ab") as handle:
            handle.write(atomic.jsonl(records).encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        self.lines.update((r["index"], r) for r in records)

    def finish(self, rows: list[dict[str, Any]]) -> None:
        """Write OUTPUT whole, in the input's order, and remove the partial files; a failed write leaves no OUTPUT
        and every completion in OUTPUT.partial."""
        merged = [{**row, **{k: v for k, v in self.lines[i].items() if k != "index"}} for i, row in enumerate(rows)]
        text = atomic.jsonl(merged)
        advice = (f"Every completion is kept in {self.partial}: free some space and run the same command again to "
                  f"write {self.output.name}")
        with atomic.write_errors(self.output, advice, lambda: len(text.encode("utf-8"))):
            atomic.write_text(self.output, text)
        self.partial.unlink()
        self.settings_file.unlink()


def completion_record(index: int, samples: list[Sample], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """One prompt's line: its index, the completions' texts and why each ended."""
    return {"index": index,
            "completions": [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples],
            "finish_reasons": [s.finish_reason for s in samples]}


def write_completions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Prompts,
                      params: SamplingParams, output: Path, settings: dict[str, Any], progress: bool = True,
                      seeds: Sequence[int] | None = None) -> Path:
    """Sample every prompt's completions into `output` (see the module docstring), each prompt from its own seed
    when given (the sampler's module docstring); returns its path."""
    out = PartialOutput(output, settings)
    sampler = Sampler(model, tokenizer.pad_token_id, formats.model_stop_ids(model, tokenizer), params)
    with tqdm(total=len(prompts.ids), initial=len(out.lines), desc="generate", unit="prompt",
              disable=not progress) as bar:
        for batch, samples in sampler.run(prompts.ids, skip=set(out.lines), seeds=seeds):
            records = [completion_record(i, s, tokenizer) for i, s in zip(batch, samples, strict=True)
                       if i not in out.lines]
            out.append(records)
            bar.update(len(records))
    out.finish(prompts.rows)
    return output


def generate_file(cfg: GenerateConfig) -> dict[str, Any]:
    """`xgblora generate`: load the model, render the prompts, write the completions; returns a summary."""
    read_prompt_rows(cfg.input_file, cfg.columns)
    output = Path(cfg.output_file)
    if output.exists():
        raise UserError(f"{output} exists; choose another --output_file (it is never overwritten)")
    resolve(cfg.model_name, cfg.adapter)
    with atomic.output_folder(output.parent, "--output_file"):
        model, tokenizer = load_with_options(cfg, cfg.model_name, cfg.adapter, cfg.chat_template)
        prompts = read_prompts(cfg.input_file, tokenizer, columns=cfg.columns, raw=cfg.raw_prompts,
                               system=cfg.system_prompt, max_length=cfg.max_length)
        settings = {k: v for k, v in asdict(cfg).items() if k not in ("output_file", "device")}
        output = write_completions(model, tokenizer, prompts, sampling_params(cfg), output, settings)
    return {"output_file": str(output), "prompts": len(prompts.ids),
            "completions": len(prompts.ids) * cfg.num_return_sequences}
