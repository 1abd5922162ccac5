"""Tool-using GRPO (generation/tools.py): a scripted rollout gives TRL's GRPOTrainer's tokens, masks and advantages
exactly; failed, slow and unknown calls stay inside the rollout; environments (reset, their methods as tools,
get_reward); bad tools and environments refused in one line before the model loads; whole runs under AdamW and
MeZO."""

import json
import math
from pathlib import Path

import pytest
import torch

from xgblora.cli import main
from xgblora.config import GRPOConfig
from xgblora.errors import UserError
from xgblora.generation.rollout import Rollout
from xgblora.generation.tools import call_tool
from xgblora.logs import read_metrics
from xgblora.models.pretrained import random_model
from xgblora.models.sampler import Sample
from xgblora.recipes import grpo

trl = pytest.importorskip("trl")
TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"  # a tool-calling template TRL can read
QUESTION = "What is 1234 + 4321?"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1234, "b": 4321}}\n</tool_call>'
TOOLS = '''
import time

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b

def boom(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("no luck")

def slow(x: int) -> str:
    """Takes its time.

    Args:
        x: Anything.
    """
    time.sleep(5)
    return "late"

def nothing(x: int) -> None:
    """Returns no text.

    Args:
        x: Anything.
    """

def undocumented(x):
    return x

def said(completions, **kwargs):
    return [float("5555" in str(c[-1]["content"])) for c in completions]

class Counter:
    def __init__(self):
        self.count = 0

    def reset(self, **row):
        self.count = 0
        return " Count with the counter."

    def increment(self, step: int) -> str:
        """Add step to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return str(self.count)

    def get_reward(self):
        return float(self.count)

class Silent:
    def reset(self, **row):
        return None

class NoReset:
    def go(self, x: int) -> str:
        """Goes.

        Args:
            x: Anything.
        """
        return "gone"
'''


@pytest.fixture
def tools(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    prompt = {"prompt": [{"role": "user", "content": QUESTION}]}
    (tmp_path / "q.jsonl").write_text(json.dumps(prompt) + "\n")
    return tmp_path


def _cfg(folder, **options):
    base = dict(model_name="tiny-llama", train_file=str(folder / "q.jsonl"), chat_template=str(TEMPLATE),
                tools=["my_tools:add"], reward_funcs=["my_tools:said"], method="lora", learning_rate=1e-3,
                max_new_tokens=256, num_return_sequences=2, per_device_train_batch_size=2, max_steps=1,
                logging_steps=1, save_strategy="no", device="cpu", seed=0, output_dir=str(folder / "run"))
    return GRPOConfig(**{**base, **options})


def _ids(tokenizer, text):
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def _scripted(tokenizer, first, after):
    """A policy that answers the first turn of rollout j with first[j % len(first)] and every later turn with
    `after`, each ended by EOS."""
    eos = tokenizer.eos_token_id

    def draw(self, prompt_ids, params):  # noqa: ARG001 (Rollout.draw's signature)
        texts = first if draw.turn == 0 else [after]
        draw.turn += 1
        return [[Sample(_ids(tokenizer, texts[(i * params.num_samples + k) % len(texts)]), "stop", 0.0, eos)
                 for k in range(params.num_samples)] for i in range(len(prompt_ids))]

    draw.turn = 0
    return draw


def _trl_rollout(tokenizer, first, after):
    """TRL's GRPOTrainer's generation batch for the same tool, reward and scripted policy."""
    import my_tools
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    model, _ = random_model("tiny-llama")
    rows = [{"prompt": [{"role": "user", "content": QUESTION}]}] * 2
    args = TRLConfig(output_dir="unused", num_generations=2, per_device_train_batch_size=2, max_completion_length=256,
                     report_to=[], use_cpu=True, max_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=my_tools.said, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, tools=[my_tools.add])
    turns = iter(range(10))

    def generate(prompt_ids, *_, **__):
        texts = first if next(turns) == 0 else [after]
        return [list(_ids(tokenizer, texts[i % len(texts)])) + [tokenizer.eos_token_id]
                for i in range(len(prompt_ids))], None

    trainer._generate_single_turn = generate
    return trainer._generate_and_score_completions(rows)


def test_a_scripted_tool_rollout_gives_trls_tokens_masks_and_advantages(tools, monkeypatch):
    cfg = _cfg(tools)
    first, after = [CALL, "I do not know."], "The sum is 5555."
    trainer, source = grpo.prepare(cfg)
    tokenizer = source.rollout.tokenizer
    monkeypatch.setattr(Rollout, "draw", _scripted(tokenizer, first, after))
    ours = source.generate().batch
    theirs = _trl_rollout(tokenizer, first, after)
    for row in range(2):
        prompt = theirs["prompt_ids"][row][theirs["prompt_mask"][row].bool()]
        completion = theirs["completion_ids"][row][theirs["completion_mask"][row].bool()]
        mask = (theirs["completion_mask"][row] * theirs["tool_mask"][row])[theirs["completion_mask"][row].bool()]
        sequence = ours.input_ids[row][ours.attention_mask[row].bool()]
        assert sequence.tolist() == prompt.tolist() + completion.tolist()
        assert ours.target_mask[row][-len(completion):].tolist() == mask.bool().tolist()
        assert int(ours.prompt_length[row]) == len(prompt)
    assert (theirs["tool_mask"][0] == 0).sum() > 0 and (theirs["tool_mask"][1] == 0).sum() == 0  # a tool turn
    torch.testing.assert_close(ours.advantages.cpu(), theirs["advantages"], atol=1e-6, rtol=0)
    assert ours.advantages[0] > 0  # the rollout that called the tool got the answer


def test_failed_slow_and_unknown_calls_are_results_not_crashes(tools):
    import my_tools

    table = {name: getattr(my_tools, name) for name in ("add", "boom", "slow", "nothing")}

    def called(name, **arguments):
        return call_tool(table, {"type": "function", "function": {"name": name, "arguments": arguments}}, 0.2)

    assert called("add", a=2, b=3) == ("add", "5", False)
    assert called("boom", x=1)[1:] == ("{'error': 'RuntimeError: no luck'}", True)
    assert called("slow", x=1)[1:] == ("{'error': 'the call took longer than 0.2 s'}", True)
    assert called("nothing", x=1)[1:] == ("{'error': 'the tool returned NoneType, not text'}", True)
    assert called("add", a=1)[2]  # a missing argument is the tool's TypeError
    assert called("missing", x=1) == ("missing", "{'error': 'Tool missing not found.'}", True)


def test_a_failing_tool_call_is_logged_and_counted_and_the_run_goes_on(tools, monkeypatch):
    cfg = _cfg(tools, tools=["my_tools:boom"], max_steps=2)
    failing = '<tool_call>\n{"name": "boom", "arguments": {"x": 1}}\n</tool_call>'
    trainer, source = grpo.prepare(cfg)
    monkeypatch.setattr(Rollout, "draw", _scripted(source.rollout.tokenizer, [failing, "no"], "The sum is 5555."))
    generation = source.generate()
    assert generation.metrics["tools/call_frequency"] == 0.5
    assert generation.metrics["tools/failure_frequency"] == 1.0
    assert generation.metrics["reward"] == 0.5  # the continuation after the error still answers


def test_an_environment_per_rollout_its_methods_tools_its_reward_a_source(tools, monkeypatch):
    cfg = _cfg(tools, tools=None, environment_factory="my_tools:Counter", reward_funcs=None)
    increment = '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call>'
    trainer, source = grpo.prepare(cfg)
    tokenizer = source.rollout.tokenizer
    assert source.rollout.rewards.names == ["Counter"] and "increment" in tokenizer.decode(source.prompts.ids[0])
    monkeypatch.setattr(Rollout, "draw", _scripted(tokenizer, [increment, "no"], "Done."))
    generation = source.generate()
    assert generation.metrics["rewards/Counter"] == 1.5  # 3 and 0: each rollout counted in its own environment
    batch = generation.batch
    text = tokenizer.decode(batch.input_ids[0][batch.attention_mask[0].bool()])
    assert "Count with the counter." in text  # reset's string joined the user's turn


@pytest.mark.parametrize("options,message", [
    (dict(tools=["my_tools:missing"]), "--tools my_tools:missing: cannot import it"),
    (dict(tools=["my_tools:undocumented"]), "tool undocumented cannot be described to the model"),
    (dict(tools=None, environment_factory="my_tools:Silent"), "has no public method to call as a tool"),
    (dict(tools=["my_tools:add", "my_tools:add"]), "two tools are named ['add']"),
    (dict(environment_factory="my_tools:NoReset", tools=None), "has no reset method"),
    (dict(environment_factory="my_tools:add", tools=None), "--environment_factory add raised TypeError"),
])
def test_bad_tools_are_one_line_before_the_model_loads(tools, monkeypatch, options, message):
    monkeypatch.setattr(grpo, "load_policy", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match=None) as error:
        grpo.prepare(_cfg(tools, **options))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_string_prompts_sent_raw_cannot_describe_tools(tools, monkeypatch):
    (tools / "s.jsonl").write_text(json.dumps({"prompt": QUESTION}) + "\n")
    monkeypatch.setattr(grpo, "load_policy", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match="s.jsonl:1: a string prompt is sent as it is"):
        grpo.prepare(_cfg(tools, train_file=str(tools / "s.jsonl")))


def test_a_template_that_cannot_render_tool_turns_is_refused(tools):
    with pytest.raises(UserError, match="cannot render a tool call and its result"):
        grpo.prepare(_cfg(tools, model_name="tiny-llama-chat", chat_template=None))


def test_tool_options_without_tools_are_refused(tools, capsys):
    code = main(["grpo", "--model_name", "tiny-llama", "--train_file", str(tools / "q.jsonl"), "--tool_timeout", "3",
                 "--output_dir", str(tools / "x")])
    assert code == 2 and "read only when the policy has tools" in capsys.readouterr().err


@pytest.mark.parametrize("trainer", ["regular", "zo"])
def test_a_whole_run_with_tools_logs_their_use(tools, trainer):
    extra = ["--zo_objective", "reward", "--zo_estimator", "es", "--zo_queries", "2", "--zo_eps", "0.05"] if trainer == "zo" else []
    code = main(["grpo", "--model_name", "tiny-llama", "--train_file", str(tools / "q.jsonl"), "--chat_template",
                 str(TEMPLATE), "--tools", "my_tools:add", "--reward_funcs", "my_tools:said", "--method", "lora",
                 "--trainer", trainer, "--max_new_tokens", "8", "--num_generations", "2",
                 "--per_device_train_batch_size", "2", "--max_steps", "2", "--logging_steps", "1", "--save_strategy",
                 "no", "--device", "cpu", "--output_dir", str(tools / trainer), *extra])
    assert code == 0
    rows = [r for r in read_metrics(tools / trainer / "metrics.jsonl") if "tools/call_frequency" in r]
    assert rows and all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
