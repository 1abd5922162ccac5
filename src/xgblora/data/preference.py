"""Preference rows in TRL's formats -> checked `PreferenceExample`s -> tokens -> `PreferenceBatch`es.

The formats of TRL's `DPOTrainer`: `prompt` / `chosen` / `rejected` as strings (standard) or as lists of
{"role", "content"} messages (conversational), and implicit-prompt rows (`chosen` / `rejected` only, the prompt
being their longest common prefix, as TRL's `extract_prompt`). Tokenisation follows TRL's: standard rows as plain
text with EOS appended to each completion, conversational rows through the chat template (the prompt with the
generation prompt, BOS once, as in SFT); the completion starts where the prompt's tokens and the prompt+completion's
diverge. Truncation: `max_prompt_length` keeps a prompt's last tokens, `max_length` cuts prompt+completion at the
end (TRL's keep_start), and a pair whose prompt alone fills max_length is dropped, as TRL drops it.

A reward model reads each pair as two whole sequences, prompt + chosen and prompt + rejected, tokenised as above
(TRL's RewardTrainer), with the row's optional `margin`; a pair either of whose sequences is longer than max_length
is dropped, as TRL's RewardTrainer filters it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from xgblora.data import formats
from xgblora.data.batches import PreferenceBatch, RewardBatch
from xgblora.data.sources import Where, parse_columns, read_rows
from xgblora.data.tasks import role_problem
from xgblora.errors import UserError, located

log = logging.getLogger("xgblora")

Text = str | list[dict]  # a string (standard) or a list of messages (conversational)
Bad = Callable[[str, str], UserError]  # the one-line error about a field of the row being read


@dataclass(frozen=True)
class PreferenceExample:
    """One checked pair: its prompt and two completions, all strings or all message lists; where it came from."""

    prompt: Text
    chosen: Text
    rejected: Text
    where: Where
    reference: str | None = None  # the answer a --verifier checks the prompt's greedy completion against
    margin: float | None = None  # how far chosen's reward should beat rejected's (a reward model's margin column)

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)

    @property
    def source(self) -> str:
        path, line = self.where
        return f"{path}:{line}" if isinstance(line, int) else f"{path}, {line}" if line else str(path)


@dataclass(frozen=True)
class PreferenceSeq:
    """A pair's tokens: the shared prompt and each completion."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def read_preferences(source: str, columns: str | None = None, split: str = "train") -> list[PreferenceExample]:
    """Every row of a file, folder or dataset id as a checked pair; a bad row is a one-line UserError naming the
    file, the row and the field."""
    return [check_row(where, row) for where, row in read_rows(source, split, parse_columns(columns))]


def check_row(where: Where, row: dict) -> PreferenceExample:
    """The row as a pair: chosen and rejected present, of one format, not empty, not equal; an implicit prompt
    extracted."""
    def bad(name: str, what: str) -> UserError:
        return located(where[0], where[1], name, what)

    for name in ("chosen", "rejected"):
        if row.get(name) is None:
            raise bad(name, f"missing: a preference row needs chosen and rejected (and prompt, unless both hold it); "
                            f"the row has: {', '.join(map(str, row)) or 'no fields'}")
    fields = {name: text_field(row[name], bad, name) for name in ("prompt", "chosen", "rejected")
              if row.get(name) is not None}
    kinds = {name: isinstance(value, list) for name, value in fields.items()}
    if len(set(kinds.values())) > 1:
        raise bad("prompt" if "prompt" in fields else "rejected",
                  "mixes formats: prompt, chosen and rejected are all strings or all lists of messages")
    prompt, chosen, rejected = (fields["prompt"], fields["chosen"], fields["rejected"]) if "prompt" in fields \
        else extract_prompt(fields["chosen"], fields["rejected"])
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value or (isinstance(value, list) and not any(m["content"] for m in value)):
            raise bad(name, "is an empty completion" + ("" if "prompt" in fields else " once the common prompt is "
                                                         "taken off"))
    if chosen == rejected:
        raise bad("rejected", "is the same as chosen: a preference pair needs two different completions")
    check_turns(prompt, {"chosen": chosen, "rejected": rejected}, "prompt" in fields, bad)
    reference = row.get("reference")
    if reference is not None and not isinstance(reference, str | int | float):
        raise bad("reference", f"expected the answer as a string or number, got {type(reference).__name__}")
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)
                               or not math.isfinite(margin)):
        raise bad("margin", f"expected a finite number, got {margin!r}")
    return PreferenceExample(prompt, chosen, rejected, where, None if reference is None else str(reference),
                             None if margin is None else float(margin))


def text_field(value: object, bad: Bad, name: str) -> Text:
    """A string, or a list of {"role", "content"} messages with string values and a chat role each."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in value):
        for i, m in enumerate(value):
            if problem := role_problem(m["role"]):  # as SFT rows: a template renders an unknown role its own way
                raise bad(f"{name}[{i}].role", problem)
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise bad(name, 'expected a string or a list of {"role": ..., "content": ...} messages')


def check_turns(prompt: Text, completions: dict[str, Text], explicit: bool, bad: Bad) -> None:
    """A prompt to condition on (not blank; a conversation ending with a turn the assistant answers), and completions
    (by field name) that are the assistant's reply: its turns, tool results between them. `explicit`: the row has a
    prompt field (else the prompt is chosen and rejected's common beginning, and the indices of their turns count
    from it)."""
    if explicit and isinstance(prompt, str) and not prompt.strip():
        raise bad("prompt", "empty string: a row needs a prompt to condition on (a pair without a prompt field takes "
                            "chosen and rejected's common beginning)")
    if not isinstance(prompt, list):
        return
    if prompt and prompt[-1]["role"] == "assistant":
        raise bad("prompt" if explicit else "chosen",
                  ("ends" if explicit else "and rejected begin with a prompt that ends")
                  + " with an assistant turn: the completions are the assistant's reply to the prompt's last turn, "
                    "so it is the user's (or a tool's)")
    offset = 0 if explicit else len(prompt)
    for name, completion in completions.items():
        for i, m in enumerate(completion):
            if m["role"] not in ("assistant", "tool") or (i == 0 and m["role"] != "assistant"):
                raise bad(f"{name}[{offset + i}].role", f"{m['role']!r} in a completion: a completion is the "
                          f"assistant's reply, starting with an assistant turn (tool results may come between its "
                          f"turns); the other turns belong in the prompt")


def extract_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text]:
    """TRL's extract_prompt: the longest common prefix (of messages, or of characters less a trailing space) is the
    prompt; (prompt, chosen's rest, rejected's rest)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space before the completion stays with it
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def encode(tokenizer: PreTrainedTokenizerBase, ex: PreferenceExample) -> PreferenceSeq:
    """The pair's tokens as TRL makes them (see the module docstring)."""
    where = f"{ex.source}: "
    if ex.conversational:
        prompt_text = formats.render(tokenizer, _turns(ex.prompt), generation_prompt=True, where=where)
    else:
        prompt_text = ex.prompt
    prompt, chosen, rejected = (formats.prompt_ids(tokenizer, t, templated=ex.conversational)
                                for t in (prompt_text, *_sequence_texts(tokenizer, ex)))
    n = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    if n == 0:
        raise UserError(f"{where}field \"prompt\": has no tokens before the completions; a pair needs a prompt to "
                        f"condition on (give the row a prompt, or use a tokenizer that adds BOS)")
    return PreferenceSeq(prompt[:n], chosen[n:], rejected[n:])


def _turns(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def _sequence_texts(tokenizer: PreTrainedTokenizerBase, ex: PreferenceExample) -> tuple[str, str]:
    """prompt + chosen and prompt + rejected as TRL writes them: through the chat template, or as text with EOS
    after each completion (where it has none)."""
    if ex.conversational:
        where = f"{ex.source}: "
        return tuple(formats.render(tokenizer, _turns(ex.prompt + c), generation_prompt=False, where=where)
                     for c in (ex.chosen, ex.rejected))
    eos = tokenizer.eos_token or ""
    return tuple(ex.prompt + (c if c.endswith(eos) else c + eos) for c in (ex.chosen, ex.rejected))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def truncate(seq: PreferenceSeq, max_length: int | None, max_prompt_length: int | None) -> PreferenceSeq | None:
    """The prompt's last max_prompt_length tokens; prompt + completion cut to max_length at the end; None when the
    prompt alone fills max_length (no completion token would be left)."""
    prompt = seq.prompt[-max_prompt_length:] if max_prompt_length else seq.prompt
    if max_length is None:
        return PreferenceSeq(prompt, seq.chosen, seq.rejected)
    room = max_length - len(prompt)
    if room <= 0:
        return None
    return PreferenceSeq(prompt, seq.chosen[:room], seq.rejected[:room])


def encode_all(tokenizer: PreTrainedTokenizerBase, examples: Sequence[PreferenceExample], max_length: int | None,
               max_prompt_length: int | None) -> list[PreferenceSeq]:
    """Every pair's tokens, truncated; the pairs whose prompt fills max_length are dropped (and counted)."""
    seqs = [truncate(encode(tokenizer, ex), max_length, max_prompt_length) for ex in examples]
    kept = [s for s in seqs if s is not None]
    if len(kept) < len(seqs):
        log.warning("%d of %d pairs dropped: the prompt alone fills --max_length %s", len(seqs) - len(kept),
                    len(seqs), max_length)
    if not kept:
        raise UserError(f"every pair's prompt fills --max_length {max_length}: raise it, or set --max_prompt_length")
    return kept


def collate_preferences(seqs: Sequence[PreferenceSeq], pad_id: int,
                        ref_logps: torch.Tensor | None = None) -> PreferenceBatch:
    """The pairs as one batch (`collate_completions`): the chosen completions, then the rejected; ref_logps
    [pairs, 2] (chosen, rejected) of these pairs, or None."""
    return collate_completions([s.prompt for s in seqs], [[s.chosen for s in seqs], [s.rejected for s in seqs]],
                               pad_id, ref_logps)


def collate_completions(prompts: Sequence[list[int]], blocks: Sequence[Sequence[list[int]]], pad_id: int,
                        ref_logps: torch.Tensor | None = None, label: torch.Tensor | None = None) -> PreferenceBatch:
    """Prompts and their completions as one batch: prompts left-padded, the blocks' completions (block j: each
    prompt's j-th) right-padded one block after the other; ref_logps [prompts, blocks] or None; label [prompts]."""
    completions = [c for block in blocks for c in block]
    wp, wc = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.full((len(prompts), wp), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), wp), dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, wp - len(p):] = torch.tensor(p)
        prompt_mask[i, wp - len(p):] = 1
    completion_ids = torch.full((len(completions), wc), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(completions), wc), dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, :len(c)] = torch.tensor(c)
        completion_mask[i, :len(c)] = 1
    ref = None if ref_logps is None else ref_logps.T.reshape(-1)
    return PreferenceBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                           completion_mask=completion_mask, ref_logps=ref, label=label)


@dataclass(frozen=True)
class RewardSeq:
    """A pair's whole sequences, prompt + chosen and prompt + rejected, as token ids; the row's margin."""

    chosen: list[int]
    rejected: list[int]
    margin: float | None = None


def check_margins(examples: Sequence[PreferenceExample]) -> None:
    """A margin is in every row or in none (TRL's collator reads the first row's); a one-line UserError naming the
    first row that differs."""
    with_margin = [ex.margin is not None for ex in examples]
    if any(with_margin) and not all(with_margin):
        first = next(ex for ex, has in zip(examples, with_margin, strict=True) if has != with_margin[0])
        what = ("missing: the rows before it give a margin, so every row needs one" if with_margin[0]
                else "given, but the first row has none: give every row a margin, or none")
        raise located(*first.where, "margin", what)


def reward_seqs(tokenizer: PreTrainedTokenizerBase, examples: Sequence[PreferenceExample],
                max_length: int | None) -> list[RewardSeq]:
    """Every pair's two sequences (TRL's RewardTrainer's tokens); the pairs with a sequence longer than max_length
    are dropped (and counted), as TRL filters them."""
    seqs = []
    for ex in examples:
        chosen, rejected = (formats.prompt_ids(tokenizer, t, templated=ex.conversational)
                            for t in _sequence_texts(tokenizer, ex))
        if max_length is None or max(len(chosen), len(rejected)) <= max_length:
            seqs.append(RewardSeq(chosen, rejected, ex.margin))
    if len(seqs) < len(examples):
        log.warning("%d of %d pairs dropped: a sequence is longer than --max_length %s", len(examples) - len(seqs),
                    len(examples), max_length)
    if not seqs:
        raise UserError(f"every pair has a sequence longer than --max_length {max_length}: raise it")
    return seqs


def collate_rewards(seqs: Sequence[RewardSeq], pad_id: int, shared: bool = False) -> RewardBatch:
    """The pairs as one batch (TRL's DataCollatorForPreference): the chosen sequences, then the rejected ones,
    right-padded; their margins. shared: also each pair split at its shared prompt (`shared_prompts`), where every
    pair of the batch has one."""
    rows = [s.chosen for s in seqs] + [s.rejected for s in seqs]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
    margin = torch.tensor([s.margin for s in seqs]) if seqs[0].margin is not None else None
    split = shared_prompts(seqs, pad_id) if shared else None
    if split is None:
        return RewardBatch(input_ids=input_ids, attention_mask=attention_mask, margin=margin)
    parts = collate_completions(*split, pad_id)
    return RewardBatch(input_ids=input_ids, attention_mask=attention_mask, margin=margin, prompt_ids=parts.prompt_ids,
                       prompt_mask=parts.prompt_mask, completion_ids=parts.completion_ids,
                       completion_mask=parts.completion_mask)


def shared_prompts(seqs: Sequence[RewardSeq], pad_id: int) -> tuple[list[list[int]], list[list[list[int]]]] | None:
    """Each pair's shared prompt, the tokens its two sequences begin with (the row's prompt and whatever else both
    begin with; for implicit-prompt rows too), and the rest of each: (prompts, [chosen rests, rejected rests]).
    Each rest keeps at least one token that is not padding, where the classifier reads its reward (its last token
    that is not `pad_id`, as transformers' sequence classifiers find it). None where a pair has no shared first token
    or a rest would be padding only (those batches run whole sequences)."""
    prompts, chosen, rejected = [], [], []
    for s in seqs:
        n = min(_common_prefix(s.chosen, s.rejected), len(s.chosen) - 1, len(s.rejected) - 1)
        if n < 1 or any(all(t == pad_id for t in rest[n:]) for rest in (s.chosen, s.rejected)):
            return None
        prompts.append(s.chosen[:n])
        chosen.append(s.chosen[n:])
        rejected.append(s.rejected[n:])
    return prompts, [chosen, rejected]
