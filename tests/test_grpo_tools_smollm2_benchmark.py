"""benchmarks/grpo_tools_smollm2.py end to end on the tiny random model (every variant, a step or two; a rerun
runs nothing again), its SFT rows rendering as GRPO's tool prompts with only the assistant turns trained, and the
calculator's rewards (benchmarks/calculator_tools.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import load_benchmark

from xgblora.data import formats
from xgblora.data.tasks import Example
from xgblora.models.pretrained import tiny_tokenizer

pytest.importorskip("trl")


def test_every_variant_lands_a_row_once(tmp_path):
    bench = load_benchmark("grpo_tools_smollm2")
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model_name", "tiny-llama-chat", "--questions", "4", "--heldout", "2",
            "--max_steps", "1", "--sft_steps", "1", "--max_new_tokens", "24", "--device", "cpu"]
    bench.main(argv)
    rows = [json.loads(line) for line in (out / "rows.jsonl").open()]
    assert [(r["variant"], r["seed"]) for r in rows] == [("no-tool", 0), ("grpo", 0), ("sft-grpo", 0)]
    for row in rows[1:]:  # the held-out figures before and after, from the stats lines `correct` wrote
        assert row["steps"] == 1 and row["accuracy before"] is not None and row["accuracy after"] is not None
        assert row["held-out calls after"] is not None and row["train calls first"] is not None
        stats = [json.loads(line) for line in (out / f"{row['variant']}-seed0-heldout-stats.jsonl").open()]
        assert len(stats) == 2 and all(s["n"] == 2 for s in stats)
        assert row["eval_reward"] == pytest.approx(stats[-1]["accuracy"])  # no shaping paid on held-out rows
    assert (out / "sft-seed0" / "final").is_dir() and rows[2]["SFT s"] > 0 and "SFT s" not in rows[1]
    configs = {v: yaml.safe_load((out / f"{v}-seed0" / "config.yaml").read_text()) for v in ("grpo", "sft-grpo")}
    assert configs["grpo"]["adapter"] is None and configs["sft-grpo"]["adapter"] == str(out / "sft-seed0" / "final")
    assert configs["grpo"]["tools"] == ["calculator_tools:add"] and configs["grpo"]["reward_weights"] == [1.0, 0.1]
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 5 and table[4].startswith("| tiny-llama-chat | sft-grpo (1 SFT steps) | 0 |")

    train = [json.loads(line)["prompt"][0]["content"] for line in (out / "questions-seed0.jsonl").open()]
    heldout = [json.loads(line)["prompt"][0]["content"] for line in (out / "heldout-seed0.jsonl").open()]
    assert len(train) == 4 and len(heldout) == 2 and not set(train) & set(heldout)

    bench.main(argv)  # every row landed: nothing runs again
    assert len((out / "rows.jsonl").read_text().splitlines()) == 3


def test_sft_rows_render_as_the_tool_prompts_and_train_the_assistant_turns(tmp_path):
    bench = load_benchmark("grpo_tools_smollm2")
    from calculator_tools import add

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = bench.qwen_template().read_text()
    row = json.loads(bench.sft_rows(tmp_path / "sft.jsonl", [(1234567, 89012345)]).read_text())
    turns = tuple((m["role"], m["content"]) for m in row["messages"])
    assert [role for role, _ in turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert turns[2][1] == '<tool_call>\n{"name": "add", "arguments": {"a": 1234567, "b": 89012345}}\n</tool_call>'
    # GRPO's prompt (the question, the tool described by the template) is the SFT row's beginning, token for token
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": turns[1][1]}], tools=[add], tokenize=False,
                                           add_generation_prompt=True)
    assert formats.render(tokenizer, turns, generation_prompt=False).startswith(prompt)
    seq = formats.conversation_seq(tokenizer, Example("", (), (), answers=(turns[-1][1],), messages=turns), 0,
                                   False, [tokenizer.eos_token_id])
    ids = seq.ids[len(seq.ids) - seq.n_target:]
    trained = "".join(tokenizer.decode([t]) if keep else "|" for t, keep in zip(ids, seq.loss_mask, strict=True))
    assert trained.startswith(turns[2][1] + "<|im_end|>\n|")  # the call, its end; then the tool turn: no loss
    assert "tool_response" not in trained and trained.rstrip("|").endswith("90246912<|im_end|>\n</s>")


def test_rewards_read_the_final_turn_and_shape_well_formed_calls(tmp_path):
    load_benchmark("grpo_tools_smollm2")
    import calculator_tools as calc

    def call(**arguments):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": arguments}}]}

    used = [call(a=1, b=2), {"role": "tool", "name": "add", "content": "3"}, {"role": "assistant", "content": "3"}]
    ends_on_call = [call(a=1, b=2)]
    wrong = [call(a=1, b="2"), {"role": "tool", "content": "12"}, {"role": "assistant", "content": "It is 3 or 4"}]
    plain = [{"role": "assistant", "content": "1 + 2 = 3"}]
    completions = [used, ends_on_call, wrong, plain]
    stats = tmp_path / "stats.jsonl"
    assert calc.correct(completions, ["3"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert calc.tool_call_shaping(completions, split=["train"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert calc.tool_call_shaping(completions, split=["heldout"] * 4) == [0.0] * 4
    calc.correct(completions, ["3"] * 4, stats=[str(stats)] * 4)
    assert json.loads(stats.read_text()) == {"n": 4, "accuracy": 0.5, "call_frequency": 0.75, "well_formed": 0.5,
                                             "example": used}
    assert calc.add(12345678, 87654321) == 99999999
