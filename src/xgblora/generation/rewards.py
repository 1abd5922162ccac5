"""Reward functions for online RL, with TRL's interface and names.

A reward function is called as f(prompts=..., completions=..., completion_ids=..., **columns) and returns one
float (or None: not scored) per completion, as in TRL's GRPOTrainer: prompts and completions are strings, or, for a
conversational prompt (a list of messages), the message list and [{"role": "assistant", "content": text}]; every
other column of the prompt rows comes as a keyword argument, one value per completion.

`--reward_funcs` names them:
- `gsm8k`, `answer_tags`, `regex:PATTERN`: correctness, 1.0 when the answer the verifier extracts agrees with the
  row's reference answer (answers.py: numbers within --answer_tolerance, else normalised strings), else 0.0;
- `math`: correctness by the math-verify package, as TRL's accuracy_reward (LaTeX, \\boxed{}, fractions, equivalent
  forms); None where the reference has no answer it can parse;
- `format:SPEC`: 1.0 when the extractor SPEC (one of the above) finds an answer at all, else 0.0;
- `module:function`: a user's function with TRL's signature, imported from the user's code (the current folder
  first) and called through usercode's guard (an exception, a wrong type or length, an infinite value: one line
  naming the function and the row); it also receives TRL's trainer_state, log_extra and log_metric.
The first correctness reward is the run's accuracy.

`--reward_model PATH` adds a reward model (`RewardModel`), scored as TRL's GRPOTrainer scores a model among its
reward_funcs: prompt + completion as text (a conversation through the reward model's chat template), tokenised
without special tokens and right-padded, the classifier's first output its reward. It comes first, as TRL's script
puts reward_model_name_or_path first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xgblora import usercode
from xgblora.adapters import trained
from xgblora.data import formats
from xgblora.errors import UserError
from xgblora.evaluation.answers import MathVerifier, Verifier, make_extractor, make_verifier

RewardFunc = Callable[..., Sequence["float | None"]]
_BUILT_IN = re.compile(r"^(gsm8k|math|answer_tags|regex:.*)$", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of a completion as TRL hands it over: a string, or a list of messages (the policy's contents
    joined: a tool's results are not its answer)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion if message.get("role") != "tool")


@dataclass
class Correct:
    """1.0 where the verifier's answer agrees with the reference (the `reference` column), else 0.0; None where the
    reference has no answer the verifier can read (the math verifier, as TRL's accuracy_reward)."""

    verifier: Verifier | MathVerifier

    def __call__(self, completions: Sequence[Any], reference: Sequence[str | None], **_: Any) -> list[float | None]:
        scores = []
        for completion, ref in zip(completions, reference, strict=True):
            if ref is None:
                raise UserError("a correctness reward needs a reference answer in every prompt row (a completion, "
                                "response, or final assistant turn; --columns completion=answer maps yours)")
            scores.append(self.verifier.scores([completion_text(completion)], ref)[0])
        return scores


@dataclass
class Formatted:
    """1.0 where the extractor finds an answer in the completion (it follows the format), else 0.0."""

    extract: Callable[[str], str | None]

    def __call__(self, completions: Sequence[Any], **_: Any) -> list[float]:
        return [float(self.extract(completion_text(c)) is not None) for c in completions]


def make_reward(spec: str, tolerance: float) -> tuple[RewardFunc, bool]:
    """The reward function a --reward_funcs entry names, and whether it scores correctness."""
    if _BUILT_IN.match(spec):
        return Correct(make_verifier(spec, tolerance)), True
    if spec.startswith("format:") and _BUILT_IN.match(spec[len("format:"):]):
        return Formatted(make_extractor(spec[len("format:"):])), False
    if usercode.SPEC.fullmatch(spec):
        return usercode.import_function("--reward_funcs", spec), False
    raise UserError(f"--reward_funcs {spec!r}: choose gsm8k, math, answer_tags, regex:PATTERN, format:<one of "
                    f"those>, or module:function")


class RewardModel:
    """A sequence classifier with one output as a reward function (see the module docstring); its forwards take
    `batch_size` completions at a time, without gradients."""

    def __init__(self, name: str, model: torch.nn.Module, tokenizer: Any, batch_size: int):
        self.name, self.model, self.tokenizer, self.batch_size = name, model, tokenizer, batch_size
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(text=texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False).to(self.device)
            scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores

    def _text(self, prompt: Any, completion: Any) -> str:
        """prompt + completion as TRL hands them to a reward model: the conversation through the chat template
        (no generation prompt), or the two strings joined."""
        if not isinstance(prompt, list):
            return prompt + completion
        turns = [(m["role"], m["content"]) for m in prompt + completion]
        return formats.render(self.tokenizer, turns, generation_prompt=False, where=f"--reward_model {self.name}: ")


def load_reward_model(spec: str, *, dtype: str, device: str, attn_implementation: str = "auto",
                      trust_remote_code: bool = False, batch_size: int = 8) -> RewardModel:
    """The reward model a --reward_model names (an xgblora reward run, its final/ or a checkpoint, a merged export,
    a model folder or hub id), checked to be a sequence classifier with one output before anything loads, then
    loaded once in eval mode, with TRL's pad token (the tokenizer's, else its EOS) in the model's config."""
    try:
        source = trained.resolve(spec)
    except UserError as exc:
        raise UserError(f"--reward_model {spec}: {exc}") from None
    outputs = trained.head_outputs(source, trust_remote_code)
    if outputs != 1:
        what = "not a sequence classifier" if outputs is None else f"a classifier with {outputs} outputs"
        raise UserError(f"--reward_model {spec}: {what}; a reward model scores with one output (an xgblora reward "
                        f"run, or a model saved by AutoModelForSequenceClassification with num_labels 1)")
    model, tokenizer = trained.load_model(source, dtype=dtype, device=device, attn_implementation=attn_implementation,
                                          trust_remote_code=trust_remote_code, head="classifier")
    model.config.pad_token_id = tokenizer.pad_token_id  # the classifier reads each row's last token before padding
    folder = trained.run_folder(spec)
    return RewardModel((folder or Path(spec.rstrip("/"))).name, model.eval(), tokenizer, batch_size)


class Rewards:
    """The run's reward functions (a reward model first, where there is one) and weights; `score` gives every
    completion's reward per function."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] | None = None, tolerance: float = 1e-6,
                 reward_model: RewardModel | None = None, environment: tuple[str, RewardFunc] | None = None):
        models = [reward_model] if reward_model is not None else []
        if not specs and not models and environment is None:
            raise UserError("--reward_funcs: give at least one reward function, a --reward_model, or an "
                            "--environment_factory whose environment has get_reward()")
        if weights is not None and len(weights) != len(specs) + len(models):
            raise UserError(f"--reward_weights has {len(weights)} values for {len(specs) + len(models)} reward "
                            f"sources")
        made = [(model, False) for model in models] + [make_reward(spec, tolerance) for spec in specs]
        self.names = [model.name for model in models] + [spec if not spec.startswith("regex:") else "regex"
                                                         for spec in specs]
        self.funcs = [func for func, _ in made]
        self.weights = torch.tensor(list(weights) if weights is not None else [1.0] * len(made))
        if environment is not None:  # the environment's own reward: one more source, weight 1 (as TRL)
            self.names.append(environment[0])
            self.funcs.append(environment[1])
            self.weights = torch.cat([self.weights, torch.ones(1)])
        self.accuracy_index = next((i for i, (_, correct) in enumerate(made) if correct), None)

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
              columns: dict[str, Any], rows: Sequence[str]) -> torch.Tensor:
        """Rewards [n, functions]; NaN where a function returned None. columns: the keyword arguments besides
        (the rows' other columns, one value per completion, and TRL's trainer_state, log_extra, log_metric); rows:
        where each completion's prompt came from, for one-line errors about the user's functions."""
        out = torch.empty(len(completions), len(self.funcs))
        for i, (name, func) in enumerate(zip(self.names, self.funcs, strict=True)):
            label = f"reward function {name}"
            with usercode.row(usercode.batch(rows)):
                values = usercode.call(label, func, prompts=prompts, completions=completions,
                                       completion_ids=completion_ids, **columns)
            out[:, i] = torch.tensor(usercode.scores(label, values, rows))
        return out

    def total(self, per_function: torch.Tensor) -> torch.Tensor:
        """The weighted sum over functions, None-rewards skipped; NaN where every function returned None."""
        total = (per_function * self.weights).nansum(dim=1)
        return total.masked_fill(torch.isnan(per_function).all(dim=1), math.nan)
