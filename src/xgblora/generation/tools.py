"""Tools inside GRPO's rollouts, with TRL's GRPOTrainer's semantics (its `tools`, `environment_factory` and
`max_tool_calling_iterations`).

The prompts describe the tools to the policy through the chat template. A completion that calls tools (read by the
tokenizer's response template, transformers' `parse_response`) gets their results as tool turns, rendered by the
template, and the policy continues after them, until a turn calls no tool, --max_tool_calling_iterations turns have,
or the completion budget (--max_completion_length, tool turns included) is spent. The tool turns' tokens are part of
the completion but carry no loss. A call that raises, outlasts --tool_timeout, names no tool of the run, or returns
no text (None, or an object that is neither a string, a number nor JSON) is a failed call: its result is the error,
the rollout goes on, and tools/failure_frequency counts it.

An environment factory makes one environment per rollout (instances are pooled and reset per rollout): its
reset(**row) starts the rollout (a string it returns joins the last user turn), its public methods are the
rollout's tools, and its get_reward(), where it has one, is one more reward source. Reward functions get the
rollouts' environments as `environments`.

Each continuation is sampled after the whole rollout so far is encoded again (the sampler keeps no cache between
turns); the tool turns are short beside the prefill of a batch, and a turn's samples run as one batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from xgblora import usercode
from xgblora.config import GRPOConfig
from xgblora.data.tasks import Example
from xgblora.errors import UserError
from xgblora.models.sampler import Sample

log = logging.getLogger("xgblora")

Draw = Callable[[list[list[int]], int, int], list[list[Sample]]]  # (prompt ids, samples each, most new tokens)


# ---------------------------------------------------------------------------------------------------- the tools


def _public_methods(environment: Any) -> list[Callable[..., Any]]:
    """An environment's tools: its public methods besides reset and get_reward (TRL's rule)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def _described(option: str, tool: Callable[..., Any]) -> None:
    """A tool the chat template can describe: transformers' JSON schema from its signature and docstring."""
    try:
        get_json_schema(tool)
    except Exception as exc:  # noqa: BLE001 -- transformers' DocstringParsingException or TypeHintParsingException
        raise UserError(f"{option}: tool {tool.__name__} cannot be described to the model ({exc}); a tool needs "
                        f"type hints on every argument and a docstring with an Args: section") from None


class Toolbox:
    """The run's tools (see the module docstring): its standalone functions, and its environment factory, probed
    once (its class, tools and reward checked) before the model loads."""

    def __init__(self, functions: Sequence[Callable[..., Any]], factory: Callable[[], Any] | None):
        self.functions, self.factory = list(functions), factory
        self.pool: list[Any] = []  # environments made so far, handed out again each generation batch
        self.has_reward = False
        probe_methods: list[Callable[..., Any]] = []
        if factory is not None:
            probe = usercode.call(f"--environment_factory {factory.__name__}", factory)
            if not callable(getattr(probe, "reset", None)):
                raise UserError(f"--environment_factory {factory.__name__}: its environment has no reset method "
                                f"(reset(**row) starts each rollout)")
            probe_methods = _public_methods(probe)
            self.has_reward = callable(getattr(probe, "get_reward", None))
            self.name = type(probe).__name__
            self.pool.append(probe)
        self.schemas = self.functions + probe_methods  # what the prompts describe
        names = [tool.__name__ for tool in self.schemas]
        if not names:
            raise UserError(f"--environment_factory {factory.__name__ if factory else ''}: the environment has no "
                            f"public method to call as a tool")
        if len(set(names)) < len(names):
            raise UserError(f"--tools: two tools are named {sorted({n for n in names if names.count(n) > 1})}; the "
                            f"model calls a tool by its name")
        for tool in self.schemas:
            _described("--environment_factory" if tool in probe_methods else "--tools", tool)

    @classmethod
    def of(cls, cfg: GRPOConfig) -> Toolbox | None:
        """The tools --tools and --environment_factory name, imported and checked; None without either."""
        if not cfg.tools and not cfg.environment_factory:
            return None
        functions = [usercode.import_function("--tools", spec) for spec in cfg.tools or ()]
        factory = usercode.import_function("--environment_factory", cfg.environment_factory) \
            if cfg.environment_factory else None
        return cls(functions, factory)

    def environments(self, n: int) -> list[Any]:
        """n environments for this batch's rollouts (made once, reused)."""
        if self.factory is None:
            return []
        while len(self.pool) < n:
            self.pool.append(usercode.call(f"--environment_factory {self.factory.__name__}", self.factory))
        return self.pool[:n]

    def tools_of(self, environment: Any | None) -> dict[str, Callable[..., Any]]:
        """What one rollout may call, by name: the functions and its environment's methods."""
        methods = _public_methods(environment) if environment is not None else []
        return {tool.__name__: tool for tool in self.functions + methods}

    def reward_function(self) -> tuple[str, Callable[..., list[float | None]]] | None:
        """The environment's get_reward as a reward function (named after its class), where it has one."""
        if not self.has_reward:
            return None

        def get_reward(environments: Sequence[Any], **_: Any) -> list[float | None]:
            return [environment.get_reward() for environment in environments]

        return self.name, get_reward


# ---------------------------------------------------------------------------------------------------- a call


def _as_text(result: Any) -> str | None:
    """A tool's result as the text of its tool turn (str() as TRL does); None for what is no text."""
    if isinstance(result, str):
        return result
    if isinstance(result, bool | int | float) or (isinstance(result, dict | list) and _is_json(result)):
        return str(result)
    return None


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _error(message: str) -> str:
    """A failed call's result, as TRL writes it: str() of {"error": message}."""
    return str({"error": message})


def call_tool(tools: dict[str, Callable[..., Any]], call: dict[str, Any], timeout: float) -> tuple[str, str, bool]:
    """(the tool's name, its result's text, whether the call failed) for one parsed tool call. A call that outlasts
    `timeout` is left to finish in its own (daemon) thread: the rollout does not wait for it."""
    function = call.get("function", call)
    name, arguments = str(function.get("name", "unknown")), function.get("arguments") or {}
    if name not in tools:
        return name, _error(f"Tool {name} not found."), True
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = tools[name](**arguments)
        except Exception as exc:  # noqa: BLE001 -- the user's tool: its failure is the call's result
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return name, _error(f"the call took longer than {timeout:g} s"), True
    if "error" in outcome:
        return name, _error(outcome["error"]), True
    text = _as_text(outcome["result"])
    if text is None:
        return name, _error(f"the tool returned {type(outcome['result']).__name__}, not text"), True
    return name, text, False


# ---------------------------------------------------------------------------------------------------- the template


def response_parser(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a response template that reads tool calls, where it has none: TRL's, for the chat
    templates TRL knows (Qwen 2.5/3, Llama 3.1/3.2, GLM-4, GPT-OSS, Gemma 4, ...); a one-line UserError otherwise."""
    if getattr(tokenizer, "response_template", None) is not None:
        return
    try:
        from trl.chat_template_utils import add_response_schema
    except ImportError:
        raise UserError("the tokenizer has no response template to read tool calls with: use a model whose tokenizer "
                        "has one, or pip install trl (its templates for Qwen, Llama 3.1, GLM-4, GPT-OSS, Gemma 4 "
                        "and others)") from None
    try:
        add_response_schema(tokenizer)
    except ValueError:
        raise UserError("the chat template has no known response template to read tool calls with; pass "
                        "--chat_template with a tool-calling template xgblora can read (Qwen 2.5's, Qwen 3's, "
                        "Llama 3.1's; TRL's chat_templates folder holds them)") from None


def check_tool_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """The chat template renders a whole tool exchange (the call's name and arguments, the tool's result): many
    templates silently drop one side of it (the check is TRL's supports_tool_calling)."""
    marks = ("tool_name_a8f3e2b1", "arg_key_b9d4f5c2", "arg_value_d6e7a9f3", "tool_result_c4f9a8e2")
    calls = [{"type": "function", "function": {"name": marks[0], "arguments": {marks[1]: marks[2]}}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "name": marks[0], "content": marks[3]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 -- jinja's TemplateError or the template's own: it cannot render the exchange
        text = ""
    if not all(mark in text for mark in marks):
        raise UserError("the chat template cannot render a tool call and its result, so the policy cannot be told "
                        "what its tools returned; pass --chat_template with a tool-calling template (Qwen 2.5's, "
                        "say)")


def tool_suffix_ids(tokenizer: PreTrainedTokenizerBase, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens that follow an assistant turn's end for these tool turns, through the next assistant header: the
    template's rendering of a dummy exchange with and without them, cut at the last EOS (TRL's
    `_get_tool_suffix_ids`, so that the rollout's tokens equal TRL's)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise UserError("the chat template renders an assistant turn differently once tool turns follow it, so tool "
                        "results cannot be appended to a rollout; pass --chat_template with a tool-calling template")
    return full[len(prefix):]


def parse_turn(tokenizer: PreTrainedTokenizerBase, ids: list[int], prefix: list[int],
               tools: Sequence[Callable[..., Any]]) -> dict[str, Any]:
    """An assistant turn as a message, its tool calls read by the response template (TRL's parse_response: a turn
    that does not parse is plain text)."""
    try:
        message = tokenizer.parse_response(ids, prefix=prefix, tools=list(tools))
        if message is None:
            raise ValueError("nothing parsed")
        content = message.get("content")
        message["content"] = content.removesuffix(tokenizer.eos_token) if isinstance(content, str) and content else ""
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("a tool call without a name")
            if function.get("arguments") is None:
                function["arguments"] = {}
    except (ValueError, TypeError):
        message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return message


# ---------------------------------------------------------------------------------------------------- the rollouts


def _observed(example: Example, observation: str) -> Example:
    """The example with an environment's observation added to its last turn (its prompt, if it has no turns)."""
    if not example.messages:
        return dataclasses.replace(example, prompt=example.prompt + observation)
    *before, (role, content) = example.messages
    return dataclasses.replace(example, messages=(*before, (role, content + observation)))


@dataclass
class ToolRollout:
    """One rollout: its prompt's tokens, the completion's (the policy's turns and the tool turns between them),
    which of those are the policy's own, and its turns as messages."""

    prompt: list[int]
    ids: list[int]
    own: list[bool]
    messages: list[dict[str, Any]]
    truncated: bool
    environment: Any | None = None
    calls: int = 0
    failures: int = 0


@dataclass
class ToolRollouts:
    """One generation's rollouts, and the first failed call's message (for the log)."""

    rollouts: list[ToolRollout]
    first_failure: str | None = field(default=None, repr=False)


class Agent:
    """Runs rollouts with tools (see the module docstring) on a sampler's draws."""

    def __init__(self, toolbox: Toolbox, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                 max_iterations: int | None, timeout: float, max_positions: int | None = None):
        self.toolbox, self.tokenizer, self.max_new_tokens = toolbox, tokenizer, max_new_tokens
        self.max_iterations = math.inf if max_iterations is None else max_iterations
        self.timeout, self.max_positions = timeout, max_positions or math.inf

    def run(self, prompts: list[list[int]], group: int, draw: Draw, environments: Sequence[Any] = (),
            starts: Sequence[list[int] | None] = ()) -> ToolRollouts:
        """`group` rollouts of each prompt, sampled, their tool calls answered and continued; `environments` one per
        rollout, `starts` the prompt of each rollout whose environment's reset changed it (None where it did not)."""
        if any(start is not None for start in starts):  # rollouts of one prompt may differ: each is sampled alone
            contexts = [start or prompts[j // group] for j, start in enumerate(starts)]
            samples = [per_prompt[0] for per_prompt in draw(contexts, 1, self.max_new_tokens)]
        else:  # the group shares its prompt's prefill
            contexts = [prompts[j // group] for j in range(len(prompts) * group)]
            samples = [s for per_prompt in draw(prompts, group, self.max_new_tokens) for s in per_prompt]
        rollouts = [self._started(prompt, sample) for prompt, sample in zip(contexts, samples, strict=True)]
        for rollout, environment in zip(rollouts, environments, strict=False):
            rollout.environment = environment
        done = ToolRollouts(rollouts)
        pending = [i for i, r in enumerate(rollouts) if r.messages[-1].get("tool_calls")]
        turns = 0
        while pending and turns < self.max_iterations:
            pending = self._answered(done, pending)
            if pending:
                pending = self._continued(rollouts, pending, draw)
            turns += 1
        if done.first_failure:
            log.warning("%d of %d tool calls failed in this generation batch; the first: %s",
                        sum(r.failures for r in rollouts), sum(r.calls for r in rollouts), done.first_failure)
        return done

    def environments(self, rows: Sequence[dict[str, Any]], examples: Sequence[Example], group: int,
                     render: Callable[[Example], list[int]]) -> tuple[list[Any], list[list[int] | None]]:
        """An environment per rollout, reset with its row (reset(**row), as TRL calls it), and the prompt of each
        rollout whose reset returned a string: its last turn with that string added (None where it returned
        None)."""
        environments = self.toolbox.environments(len(rows) * group)
        starts: list[list[int] | None] = []
        for j, environment in enumerate(environments):
            row, example = rows[j // group], examples[j // group]
            with usercode.row(example.source):
                observation = usercode.call(f"environment {self.toolbox.name}'s reset", environment.reset, **row)
            if observation is not None and not isinstance(observation, str):
                raise UserError(f"{example.source}: environment {self.toolbox.name}'s reset returned "
                                f"{type(observation).__name__}; it returns a string to add to the prompt, or None")
            starts.append(None if observation is None else render(_observed(example, observation)))
        return environments, starts

    def _started(self, prompt: list[int], sample: Sample) -> ToolRollout:
        ids = list(sample.token_ids) + ([sample.stop_id] if sample.stop_id is not None else [])
        message = parse_turn(self.tokenizer, ids, prompt, self.toolbox.schemas)
        return ToolRollout(prompt, ids, [True] * len(ids), [message], sample.finish_reason == "length")

    def _answered(self, done: ToolRollouts, pending: list[int]) -> list[int]:
        """Call the tools of each pending rollout's last turn and append their results; those whose results would
        overrun the budget end here, without them (TRL's rule), and are left out of what is returned."""
        kept = []
        for i in pending:
            rollout = done.rollouts[i]
            tools = self.toolbox.tools_of(rollout.environment)
            results = []
            for call in rollout.messages[-1]["tool_calls"]:
                name, text, failed = call_tool(tools, call, self.timeout)
                rollout.calls += 1
                if failed:
                    rollout.failures += 1
                    done.first_failure = done.first_failure or f"{name}: {text}"
                results.append({"role": "tool", "name": name, "content": text})
            suffix = tool_suffix_ids(self.tokenizer, results)
            if len(rollout.ids) + len(suffix) > self.max_new_tokens or \
                    len(rollout.prompt) + len(rollout.ids) + len(suffix) >= self.max_positions:
                continue
            rollout.messages += results
            rollout.ids += suffix
            rollout.own += [False] * len(suffix)
            kept.append(i)
        return kept

    def _continued(self, rollouts: list[ToolRollout], pending: list[int], draw: Draw) -> list[int]:
        """The policy's next turn of each pending rollout (one sample each, within the budget left); those that call
        tools again."""
        pending = [i for i in pending if len(rollouts[i].ids) < self.max_new_tokens]  # a budget left to continue
        if not pending:
            return []
        contexts = [rollouts[i].prompt + rollouts[i].ids for i in pending]
        budget = max(self.max_new_tokens - len(rollouts[i].ids) for i in pending)
        samples = [per_prompt[0] for per_prompt in draw(contexts, 1, budget)]
        calling = []
        for i, context, sample in zip(pending, contexts, samples, strict=True):
            rollout = rollouts[i]
            ids = list(sample.token_ids) + ([sample.stop_id] if sample.stop_id is not None else [])
            left = self.max_new_tokens - len(rollout.ids)
            rollout.truncated = sample.finish_reason == "length" or len(ids) > left
            ids = ids[:left]
            rollout.ids += ids
            rollout.own += [True] * len(ids)
            if ids:
                rollout.messages.append(parse_turn(self.tokenizer, ids, context, self.toolbox.schemas))
                if rollout.messages[-1].get("tool_calls"):
                    calling.append(i)
        return calling
