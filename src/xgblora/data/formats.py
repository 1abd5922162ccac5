"""Instruction data as tokens: conversations through the tokenizer's chat template, prompt/completion pairs and
plain text, each with the end-of-sequence token in its target and a mask of the tokens that carry loss.

What carries loss:
- a conversation (`messages`, or TRL's conversational prompt/completion): the assistant turns from
  `Example.trained_from` on, each with what the template writes after it (its end-of-turn token);
- prompt/completion: the completion and EOS;
- text: every token and EOS.
With train_on_prompt every token after the first carries loss.

Assistant turns are found by rendering the conversation cut before and after each of them
(`apply_chat_template(messages[:i], add_generation_prompt=True)`, then `messages[:i + 1]`): the characters between
the two renderings are the turn. This needs no `{% generation %}` markers, which most templates lack, but it needs
a template that renders a conversation's beginning the same whether or not more turns follow; one that does not is
refused with the row named. The whole conversation is then tokenised once, and a token carries loss when it overlaps
an assistant turn (so " 4", after a generation prompt ending in a space, is the answer's first token).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from xgblora.data.collation import TokenSeq, encode_pairs, gold_continuation
from xgblora.data.tasks import Example
from xgblora.errors import UserError


def read_chat_template(path: str) -> str:
    """The Jinja chat template in a file (--chat_template), read before any model loads; it replaces the
    tokenizer's own."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--chat_template {path}: cannot read ({exc.__class__.__name__}: {exc})") from None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | list[int] | None = None) -> list[int]:
    """Tokens that end an answer: the tokenizer's EOS and the model's generation-config EOS (e.g. <|eot_id|>)."""
    extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return list(dict.fromkeys(t for t in [tokenizer.eos_token_id, *extra] if t is not None))


def model_stop_ids(model: object, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """`stop_token_ids` of a model: its generation config's EOS beside the tokenizer's (none without a config)."""
    generation = getattr(model, "generation_config", None)
    return stop_token_ids(tokenizer, getattr(generation, "eos_token_id", None))


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]], generation_prompt: bool,
           where: str = "", tools: Sequence[Callable[..., Any]] | None = None) -> str:
    """The chat template's text for a conversation (with the tools described to the model, where given); a template
    that is missing or fails is a one-line UserError."""
    if tokenizer.chat_template is None:
        raise UserError("this tokenizer has no chat template, so conversation rows cannot be rendered; pass "
                        "--chat_template FILE (a Jinja template), or use prompt/completion rows")
    try:
        # `or None`: some templates (Llama 3's) write their tool preamble for an empty list too
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                             add_generation_prompt=generation_prompt, tools=list(tools or ()) or None)
    except Exception as exc:  # noqa: BLE001 -- jinja's TemplateError, or an exception the template raises itself
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{where}the chat template failed to render ({type(exc).__name__}: {first})") from None


def prompt_text(tokenizer: PreTrainedTokenizerBase, ex: Example) -> str:
    """What a model continues to answer an example: its rendered conversation up to the last assistant turn."""
    if not ex.messages:
        return ex.prompt
    last = max(i for i, (role, _) in enumerate(ex.messages) if role == "assistant")
    return render(tokenizer, ex.messages[:last], generation_prompt=True)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, templated: bool) -> list[int]:
    """The tokens of a prompt text (`prompt_text`); a rendered template's with BOS once (see `conversation_seq`)."""
    if not templated:
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    return _with_bos(tokenizer, text, tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_turns(tokenizer: PreTrainedTokenizerBase, ex: Example, raw: bool = False,
                 system: str | None = None) -> list[tuple[str, str]]:
    """The conversation a prompt row (`PromptTask`) stands for: its messages, or a string prompt as a user turn
    when the tokenizer has a chat template (unless raw); none for a string sent as it is. A system prompt goes
    first in a conversation that has none."""
    turns = list(ex.messages) or ([("user", ex.prompt)] if tokenizer.chat_template is not None and not raw else [])
    if turns and system and turns[0][0] != "system":
        turns.insert(0, ("system", system))
    return turns


def generation_prompt_ids(tokenizer: PreTrainedTokenizerBase, ex: Example, raw: bool = False,
                          system: str | None = None, tools: Sequence[Callable[..., Any]] | None = None) -> list[int]:
    """The tokens a model continues for a prompt row: `prompt_turns` through the chat template (describing `tools`),
    else the string prompt as it is."""
    turns = prompt_turns(tokenizer, ex, raw, system)
    if not turns:
        return prompt_ids(tokenizer, ex.prompt, templated=False)
    text = render(tokenizer, turns, generation_prompt=True, where=f"{ex.source}: ", tools=tools)
    return prompt_ids(tokenizer, text, templated=True)


def _with_bos(tokenizer: PreTrainedTokenizerBase, text: str, ids: list[int]) -> list[int]:
    """BOS before a rendered template's tokens where the tokenizer adds one and the template did not write it."""
    return [tokenizer.bos_token_id, *ids] if _adds_bos(tokenizer) and not text.startswith(tokenizer.bos_token) else ids


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]


def _assistant_spans(tokenizer: PreTrainedTokenizerBase, ex: Example, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each trained assistant turn in it."""
    text = render(tokenizer, ex.messages, generation_prompt=False, where=where)
    spans = []
    for i, (role, _) in enumerate(ex.messages):
        if role != "assistant" or i < ex.trained_from:
            continue
        before = render(tokenizer, ex.messages[:i], generation_prompt=True, where=where)
        through = render(tokenizer, ex.messages[:i + 1], generation_prompt=False, where=where)
        if not (through.startswith(before) and text.startswith(through)):
            raise UserError(f"{where}the chat template renders the start of this conversation differently when "
                            f"more turns follow (assistant turn {i}), so its turns cannot be told apart; pass a "
                            f"--chat_template that renders every turn the same way")
        spans.append((len(before), len(through)))
    return text, spans


def conversation_seq(tokenizer: PreTrainedTokenizerBase, ex: Example, index: int, train_on_prompt: bool,
                     stop_ids: Sequence[int]) -> TokenSeq:
    """A conversation's tokens, scoring its assistant turns; EOS is appended when the template ends the last turn
    without a stop token. BOS is added only where the tokenizer adds one and the template did not write it."""
    where = f"{ex.source}: " if ex.source else f"example {index}: "
    text, spans = _assistant_spans(tokenizer, ex, where)
    if not spans:
        raise UserError(f"{where}no assistant turn to train on")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    scored = [any(start < b and end > a for a, b in spans) for start, end in offsets]
    last_turn = {t for t, (start, _) in zip(ids, offsets, strict=True) if start >= spans[-1][0]}
    if not last_turn & set(stop_ids):
        ids, scored = [*ids, tokenizer.eos_token_id], [*scored, True]
    with_bos = _with_bos(tokenizer, text, ids)
    ids, scored = with_bos, [False] * (len(with_bos) - len(ids)) + scored
    if train_on_prompt:
        scored = [False, *[True] * (len(ids) - 1)]
    first = scored.index(True)
    mask = tuple(scored[first:])
    return TokenSeq(tuple(ids), len(ids) - first, index, 0, None if all(mask) else mask)


def instruction_seqs(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                     train_on_prompt: bool = False, stop_ids: Sequence[int] = ()) -> list[TokenSeq]:
    """Tokenise instruction examples for training (see the module docstring for what carries loss), truncated from
    the left to max_length tokens (the answer is kept); one warning gives the count."""
    stop_ids = list(stop_ids) or stop_token_ids(tokenizer)
    plain = [i for i, ex in enumerate(examples) if not ex.messages]
    pairs = encode_pairs(tokenizer, [Example(examples[i].prompt, (gold_continuation(examples[i]),), (0,))
                                     for i in plain], max_length=1 << 62)
    seqs: dict[int, TokenSeq] = {}
    for i, pair in zip(plain, pairs, strict=True):
        ids = (*pair.ids, tokenizer.eos_token_id)
        n_target = len(ids) - 1 if train_on_prompt else pair.n_target + 1
        seqs[i] = TokenSeq(ids, n_target, i, 0)
    for i, ex in enumerate(examples):
        if ex.messages:
            seqs[i] = conversation_seq(tokenizer, ex, i, train_on_prompt, stop_ids)
    out = [seqs[i] for i in range(len(examples))]
    truncated = sum(len(s.ids) > max_length for s in out)
    if truncated:
        warnings.warn(f"{truncated} of {len(out)} training examples were longer than max_length={max_length} tokens "
                      f"and were truncated from the left (the answer is kept)", stacklevel=2)
    return [s.truncated(max_length) for s in out]
