"""`xgblora chat`: talk to a model in the terminal. Each reply streams token by token as it is sampled; the whole
conversation goes through the chat template every turn. `/reset` starts over, `/exit` or end of input leaves.

Replies go to stdout, one line break after each; the `>>> ` prompt and notices go to stderr, so a piped conversation's
stdout holds the replies only.
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch
from transformers import PreTrainedTokenizerBase, TextStreamer

from xgblora.adapters.trained import load_with_options
from xgblora.config import ChatConfig
from xgblora.data import formats
from xgblora.errors import UserError
from xgblora.generation.generate import sampling_params
from xgblora.models.sampler import Sampler, batch_generator


class _ReplyStream(TextStreamer):
    """transformers' streamer (it holds text back until a word or character is whole), writing to a given stream."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, out: TextIO):
        super().__init__(tokenizer, skip_special_tokens=True)
        self.out = out

    def on_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:  # noqa: ARG002 -- one row
        """The sampler's per-step callback: stream the new token."""
        self.put(tokens.cpu())

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


def chat(cfg: ChatConfig, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    """Run the conversation loop until /exit or end of input; returns the exit code."""
    model, tokenizer = load_with_options(cfg, cfg.model_name, cfg.adapter, cfg.chat_template)
    if tokenizer.chat_template is None:
        raise UserError(f"{cfg.model_name}: the tokenizer has no chat template; pass --chat_template FILE")
    if stdin.isatty():
        import readline  # noqa: F401 -- line editing and history for input read from a terminal
    sampler = Sampler(model, tokenizer.pad_token_id, formats.model_stop_ids(model, tokenizer), sampling_params(cfg, 1))
    opening = [("system", cfg.system_prompt)] if cfg.system_prompt else []
    history = list(opening)
    stderr.write(f"chatting with {cfg.model_name}: /reset starts over, /exit or Ctrl-D leaves\n")
    for turn in _user_turns(stdin, stderr):
        if turn == "/reset":
            history = list(opening)
            continue
        history.append(("user", turn))
        text = formats.render(tokenizer, history, generation_prompt=True)
        ids = formats.prompt_ids(tokenizer, text, templated=True)[-cfg.max_length:]
        stream = _ReplyStream(tokenizer, stdout)
        generator = batch_generator(cfg.seed, len(history), sampler.device)
        [[sample]] = sampler.sample_batch([ids], generator, on_tokens=stream.on_tokens)
        stream.end()
        history.append(("assistant", tokenizer.decode(sample.token_ids, skip_special_tokens=True)))
    return 0


def _user_turns(stdin: TextIO, stderr: TextIO):
    """The user's non-empty lines, until /exit or end of input; text that is not UTF-8 is a one-line UserError."""
    while True:
        stderr.write(">>> ")
        stderr.flush()
        try:
            line = stdin.readline()
            line.encode("utf-8")  # under a POSIX locale, stdin turns bytes that are not UTF-8 into surrogates
        except UnicodeError as exc:
            raise UserError(f"standard input is not UTF-8 text ({exc.reason}); convert it first, e.g. with "
                            f"iconv -t UTF-8") from None
        if not line or line.strip() == "/exit":
            return
        if line.strip():
            yield line.strip()
