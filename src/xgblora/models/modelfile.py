"""An Ollama Modelfile for a GGUF file: FROM the file, the chat template as Ollama's TEMPLATE, the template's default
system prompt as SYSTEM, and the stop tokens.

Ollama's templates are Go templates, not Jinja, so the chat template is rendered instead of copied: transformers'
apply_chat_template on a system, user and assistant message holding markers, one message more each time. What each
message adds, with its marker replaced by `{{ .Content }}`, becomes that role's branch of a range over .Messages, and
what add_generation_prompt adds follows the last user message. This fits templates where each message appends its
own text (ChatML, Zephyr, Llama 3 and most others); one that rewrites earlier text when a message is added (a system
prompt folded into the first user turn) is refused with one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from xgblora.errors import UserError

MARKERS = {"system": "\x00SYSTEM\x00", "user": "\x00USER\x00", "assistant": "\x00ASSISTANT\x00"}


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool = False) -> str:
    if not messages and not generation:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def role_pieces(tokenizer: Any) -> tuple[dict[str, str], str, str | None]:
    """Each role's text around `{{ .Content }}`, the generation prompt, and the system prompt the template puts
    first when the conversation has none (None if it puts none)."""
    where = "the chat template"
    if not tokenizer.chat_template:
        raise UserError("--ollama_modelfile: the model has no chat template to write as TEMPLATE")
    conversation = [{"role": role, "content": marker} for role, marker in MARKERS.items()]
    texts = [_render(tokenizer, conversation[:n]) for n in range(len(conversation) + 1)]
    pieces = {}
    for n, message in enumerate(conversation):
        before, after = texts[n], texts[n + 1]
        added = after[len(before):]
        if not after.startswith(before) or added.count(message["content"]) != 1:
            raise UserError(f"--ollama_modelfile: {where} does not append each message's text after the ones before "
                            f"(the {message['role']} message changes it); write the Modelfile's TEMPLATE by hand")
        pieces[message["role"]] = added.replace(message["content"], "{{ .Content }}")
    bos = tokenizer.bos_token or ""
    if bos and pieces["system"].startswith(bos) and not pieces["user"].startswith(bos):
        pieces["system"] = pieces["system"][len(bos):]  # BOS opens the text, not a message: the runtime adds it
    generation = _render(tokenizer, conversation[:2], generation=True)[len(texts[2]):]
    return pieces, generation, _default_system(tokenizer, pieces)


def _default_system(tokenizer: Any, pieces: dict[str, str]) -> str | None:
    """The system prompt the template adds before a conversation that starts with a user message."""
    alone = _render(tokenizer, [{"role": "user", "content": MARKERS["user"]}])
    user = pieces["user"].replace("{{ .Content }}", MARKERS["user"])
    first = alone[: len(alone) - len(user)] if alone.endswith(user) else ""
    bos = tokenizer.bos_token or ""
    if bos and first.startswith(bos) and not pieces["system"].startswith(bos):
        first = first[len(bos):]
    if not first:
        return None
    head, _, tail = pieces["system"].partition("{{ .Content }}")
    if not (first.startswith(head) and first.endswith(tail)):
        raise UserError("--ollama_modelfile: the chat template puts text before a first user message that is not "
                        "a system message; write the Modelfile's TEMPLATE by hand")
    return first[len(head): len(first) - len(tail)]


def template(pieces: dict[str, str], generation: str) -> str:
    """The Go template: one branch per role in a range over .Messages, the generation prompt after the last user
    message. No `{{-` trimming: the pieces' own newlines are the template's."""
    return ("{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
            f'{{{{ if eq .Role "system" }}}}{pieces["system"]}'
            f'{{{{ else if eq .Role "user" }}}}{pieces["user"]}{{{{ if $last }}}}{generation}{{{{ end }}}}'
            f'{{{{ else if eq .Role "assistant" }}}}{pieces["assistant"]}{{{{ end }}}}{{{{ end }}}}')


def stop_tokens(tokenizer: Any, pieces: dict[str, str], generation: str) -> list[str]:
    """EOS and every special token the template writes (a model that starts a new turn has finished its own)."""
    text = "".join(pieces.values()) + generation
    found = [t for t in tokenizer.all_special_tokens if t in text and t != tokenizer.bos_token]
    return list(dict.fromkeys([tokenizer.eos_token, *found]) if tokenizer.eos_token else found)


def modelfile_text(gguf_file: Path, modelfile: Path, tokenizer: Any) -> str:
    """The Modelfile for `gguf_file` written at `modelfile` (FROM is relative to the Modelfile's folder)."""
    pieces, generation, system = role_pieces(tokenizer)
    body = template(pieces, generation)
    if '"""' in body or (system and '"""' in system):
        raise UserError('--ollama_modelfile: the chat template contains """, which a Modelfile cannot quote')
    source = os.path.relpath(Path(gguf_file).resolve(), Path(modelfile).resolve().parent)
    lines = [f"FROM ./{source}" if not source.startswith("..") else f"FROM {Path(gguf_file).resolve()}",
             f'TEMPLATE """{body}"""']
    if system is not None:
        lines.append(f'SYSTEM """{system}"""')
    lines += [f'PARAMETER stop "{token}"' for token in stop_tokens(tokenizer, pieces, generation)]
    return "\n".join(lines) + "\n"
