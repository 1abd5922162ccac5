"""Instruction and chat data: formats and sources, what carries loss (token by token), EOS, the token-mean loss,
generation stopping at EOS, and end-to-end SFT of a chat model on GSM8K in three forms."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from peft import PeftModel
from tokenizers import processors
from transformers import AutoTokenizer

from xgblora import parsing
from xgblora.config import Config
from xgblora.data import formats
from xgblora.data.collation import collate, collate_packed
from xgblora.data.splits import load_rows
from xgblora.data.tasks import CustomTask, Example
from xgblora.errors import UserError
from xgblora.evaluation import instructions as instruction_eval
from xgblora.evaluation.answers import Verifier, make_extractor
from xgblora.logs import read_metrics
from xgblora.models import pretrained, scoring
from xgblora.models.sampler import greedy_continuations
from xgblora.recipes import sft
from xgblora.train.objective import per_example_loss

CONVERSATION = (("system", "Be brief."), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"),
                ("assistant", "6, since 3+3=6"))


@pytest.fixture(scope="module")
def chat_model():
    return pretrained.random_model("tiny-llama-chat", seed=1)


def gsm8k_rows(glue_data: Path, n: int) -> list[dict]:
    with open(glue_data / "gsm8k" / "train.jsonl", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def custom(**kw) -> CustomTask:
    return CustomTask(Config(task_name="custom", train_file="t.jsonl", **kw).data)


# ----------------------------------------------------------------------------- formats and sources

def test_each_format_becomes_the_right_example():
    task = custom()
    messages = [{"role": r, "content": c} for r, c in CONVERSATION]
    (ex,) = task.examples({"messages": messages}, ("t.jsonl", 3))
    assert (ex.messages, ex.trained_from, ex.answers, ex.source) == (CONVERSATION, 0, ("6, since 3+3=6",), "t.jsonl:3")
    (ex,) = task.examples({"prompt": messages[:4], "completion": messages[4:]}, ("t.jsonl", 1))
    assert (ex.messages, ex.trained_from) == (CONVERSATION, 4)  # TRL's conversational prompt/completion
    assert task.examples({"prompt": "2+2=", "completion": "4"}, ("t", 1))[0] == \
        Example("2+2=", (), (), answers=("4",), source="t:1")
    assert task.examples({"prompt": "2+2=", "response": "4"}, ("t", 1))[0].answers == ("4",)
    assert task.examples({"text": "Once upon a time."}, ("t", 1))[0] == \
        Example("", (), (), answers=("Once upon a time.",), source="t:1")
    forced = custom(data_format="text")
    assert forced.examples({"text": "x", "prompt": "p"}, ("t", 1))[0].prompt == ""


@pytest.mark.parametrize(("row", "message"), [
    ({"question": "q"}, r't\.jsonl:2: field "messages": missing: instruction rows hold "messages", "prompt" and '
                        r'"completion" \(or "response"\), or "text" .*the row has: question'),
    ({"messages": "hi"}, r't\.jsonl:2: field "messages": expected a list, got str'),
    ({"messages": []}, r't\.jsonl:2: field "messages": empty list of messages'),
    ({"messages": [{"role": "user", "content": "hi"}]}, r'field "messages": no message with role "assistant"'),
    ({"messages": [{"content": "hi"}]}, r'field "messages\[0\]\.role": missing'),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": "a"},
     r'field "completion": expected a list, got str'),
])
def test_bad_instruction_rows_are_one_line_errors(row, message):
    with pytest.raises(UserError, match=message):
        custom().examples(row, ("t.jsonl", 2))


def _write_sources(folder: Path, rows: list[dict]) -> dict[str, str]:
    """The same rows as JSONL, a JSON array, CSV, parquet, arrow and a save_to_disk folder (with renamed columns)."""
    renamed = [{"question": r["prompt"], "answer": r["completion"]} for r in rows]
    (folder / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    (folder / "d.json").write_text(json.dumps(renamed))
    with open(folder / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["question", "answer"])
        writer.writeheader()
        writer.writerows(renamed)
    table = datasets.Dataset.from_list(renamed)
    table.to_parquet(str(folder / "d.parquet"))
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(folder / "saved"))
    arrow = next((folder / "saved" / "train").glob("*.arrow"))
    return {"jsonl": str(folder / "d.jsonl"), "json": str(folder / "d.json"), "csv": str(folder / "d.csv"),
            "parquet": str(folder / "d.parquet"), "arrow": str(arrow), "saved": str(folder / "saved")}


def test_every_source_with_a_column_map_gives_the_same_examples(tmp_path):
    rows = [{"prompt": f"What is {i}+{i}?", "completion": f"#### {2 * i}"} for i in range(5)]
    expected = [(r["prompt"], r["completion"]) for r in rows]
    for kind, source in _write_sources(tmp_path, rows).items():
        task = CustomTask(Config(task_name="custom", train_file=source, eval_file=source,
                                 columns="prompt=question,completion=answer").data)
        for split in ("train", "eval"):
            got = [(ex.prompt, ex.answers[0]) for ex in load_rows(task, split, None)]
            assert got == expected, (kind, split)


def test_source_errors_name_the_file_and_the_row_or_line(tmp_path):
    sources = _write_sources(tmp_path, [{"prompt": "p", "completion": "c"}] * 2)
    for kind, where in (("csv", r", row 1"), ("jsonl", r":1")):
        task = CustomTask(Config(task_name="custom", train_file=sources[kind], columns="prompt=question,completion=nope").data)
        with pytest.raises(UserError, match=rf'd\.{kind}{where}: field "nope": missing \(--columns maps it to '
                                            rf"'completion'\); the row has: question, answer"):
            load_rows(task, "train", None)
    with pytest.raises(UserError, match=r"missing\.parquet: no such file"):
        load_rows(CustomTask(Config(task_name="custom", train_file=str(tmp_path / "missing.parquet")).data), "train", None)
    with pytest.raises(UserError, match=r"--columns 'prompt': 'prompt' is not OURS=THEIRS"):
        custom(columns="prompt")


# ----------------------------------------------------------------------------- what carries loss

def _scored_text(tokenizer, seq) -> list[str]:
    """The decoded runs of consecutive scored tokens of a sequence."""
    offsets, runs, last = seq.target_offsets(), [], None
    for k in offsets:
        if last is None or k != last + 1:
            runs.append([])
        runs[-1].append(seq.ids[k])
        last = k
    return [tokenizer.decode(run) for run in runs]


def test_a_multi_turn_conversation_scores_its_assistant_turns_and_their_eos(chat_model):
    _, tokenizer = chat_model
    (seq,) = formats.instruction_seqs(tokenizer, [Example("", (), (), messages=CONVERSATION)], 1024)
    assert _scored_text(tokenizer, seq) == ["4</s>\n", "6, since 3+3=6</s>\n"]  # the template's end of turn
    assert tokenizer.decode(seq.ids) == formats.render(tokenizer, CONVERSATION, generation_prompt=False)
    (completion_only,) = formats.instruction_seqs(tokenizer, [Example("", (), (), messages=CONVERSATION,
                                                                   trained_from=4)], 1024)
    assert _scored_text(tokenizer, completion_only) == ["6, since 3+3=6</s>\n"]
    (everything,) = formats.instruction_seqs(tokenizer, [Example("", (), (), messages=CONVERSATION)], 1024,
                                          train_on_prompt=True)
    assert everything.target_offsets() == list(range(1, len(everything.ids)))


def test_eos_is_appended_where_the_template_ends_a_turn_without_it(chat_model):
    _, tokenizer = chat_model
    tokenizer = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>",
                                    eos_token="</s>", bos_token="<s>")
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}[assistant] {% endif %}")
    (seq,) = formats.instruction_seqs(tokenizer, [Example("", (), (), messages=CONVERSATION[1:3])], 1024)
    assert _scored_text(tokenizer, seq) == [" 4\n</s>"]  # " 4" is one token that starts in the prompt
    assert seq.ids[-1] == tokenizer.eos_token_id


def test_bos_once_whether_or_not_the_template_writes_it(chat_model):
    _, base = chat_model
    tokenizer = base.__class__(tokenizer_object=base.backend_tokenizer, pad_token="<pad>", eos_token="</s>",
                               bos_token="<s>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    assert tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id  # this tokenizer adds BOS
    ex = Example("", (), (), messages=CONVERSATION[1:3])
    for template in (pretrained.ZEPHYR_CHAT_TEMPLATE, "{{ bos_token }}" + pretrained.ZEPHYR_CHAT_TEMPLATE):
        tokenizer.chat_template = template
        (seq,) = formats.instruction_seqs(tokenizer, [ex], 1024)
        assert seq.ids.count(tokenizer.bos_token_id) == 1 and seq.ids[0] == tokenizer.bos_token_id, template
        assert formats.prompt_ids(tokenizer, formats.prompt_text(tokenizer, ex), True).count(tokenizer.bos_token_id) == 1


def test_prompt_completion_and_text_rows_score_their_answer_and_eos(chat_model):
    _, tokenizer = chat_model
    pair, text = formats.instruction_seqs(tokenizer, [Example("What is 2+2?", (), (), answers=("4",)),
                                                   Example("", (), (), answers=("Once upon a time.",))], 1024)
    assert _scored_text(tokenizer, pair) == [" 4</s>"] and pair.ids[-1] == tokenizer.eos_token_id
    assert _scored_text(tokenizer, text) == ["Once upon a time.</s>"]


def test_templates_that_fail_or_are_missing_are_one_line_errors(chat_model, tmp_path):
    _, base = chat_model
    tokenizer = base.__class__(tokenizer_object=base.backend_tokenizer, pad_token="<pad>", eos_token="</s>")
    ex = Example("", (), (), messages=CONVERSATION[1:3], source="chat.jsonl:7")
    with pytest.raises(UserError, match="this tokenizer has no chat template.*--chat_template FILE"):
        formats.instruction_seqs(tokenizer, [ex], 1024)
    (tmp_path / "bad.jinja").write_text("{{ raise_exception('only user turns') }}")
    tokenizer.chat_template = formats.read_chat_template(str(tmp_path / "bad.jinja"))
    with pytest.raises(UserError, match=r"chat\.jsonl:7: the chat template failed to render \(TemplateError: only"):
        formats.instruction_seqs(tokenizer, [ex], 1024)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(UserError, match=r"chat\.jsonl:7: the chat template renders the start of this conversation "
                                        r"differently when more turns follow \(assistant turn 1\)"):
        formats.instruction_seqs(tokenizer, [ex], 1024)


# ----------------------------------------------------------------------------- loss and generation

def test_token_mean_loss_is_huggingfaces_masked_label_loss(chat_model):
    model, tokenizer = chat_model
    examples = [Example("", (), (), messages=CONVERSATION), Example("Hi", (), (), answers=("there, friend",)),
                Example("", (), (), answers=("A short text.",))]
    seqs = formats.instruction_seqs(tokenizer, examples, 1024)
    batch = collate(seqs, tokenizer.pad_token_id).token_mean()
    ours = per_example_loss(model, batch).mean()
    labels = torch.full_like(batch.input_ids, -100)  # HF's reference: -100 everywhere but the target tokens
    k = batch.target_mask.shape[1]
    labels[:, -k:] = torch.where(batch.target_mask, batch.input_ids[:, -k:], -100)
    reference = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, labels=labels).loss
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    halves = sum(per_example_loss(model, batch.split(a, b)).mean() * (b - a) / 3 for a, b in ((0, 2), (2, 3)))
    torch.testing.assert_close(halves, reference, rtol=1e-5, atol=1e-6)  # micro-batches add up to it
    packed = per_example_loss(model, collate_packed(seqs, token_mean=True)).mean()
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("leaf", [True, False])  # a model's logits are no leaf: their backward overwrites them
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 5 positions a row: chunks of 3 split each row in two, the second one short; chunks of 10 hold two whole rows
@pytest.mark.parametrize("chunk", [3, 10])
def test_chunked_target_logprobs_match_autograd_of_log_softmax(monkeypatch, dtype, leaf, chunk):
    monkeypatch.setattr(scoring, "LOGPROB_CHUNK_ROWS", chunk)
    torch.manual_seed(0)
    x = torch.randn(3, 6, 37, dtype=dtype, requires_grad=True)  # the last position predicts nothing
    targets, weights = torch.randint(0, 37, (3, 5)), torch.randn(3, 5)
    logits = x if leaf else x * 2
    ours = scoring.token_logprobs(logits, targets)
    (grad,) = torch.autograd.grad((ours * weights).sum(), x)
    logits = x if leaf else x * 2
    reference = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), x)
    assert ours.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    # the same fp32 gradient summed in another order may round to the neighbouring bf16 value (one ulp, 2**-8)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-6 if dtype == torch.float32 else 2**-8, atol=1e-6)


def test_generation_stops_at_a_stop_token(chat_model):
    model, tokenizer = chat_model
    ex = Example("", (), (), messages=CONVERSATION[1:3])
    prompt = formats.prompt_ids(tokenizer, formats.prompt_text(tokenizer, ex), True)
    free = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=None)[0, len(prompt):].tolist()
    stop = free[2]
    first = free.index(stop)  # greedy decoding up to the first occurrence of the stop token, which it leaves out
    (text,) = greedy_continuations(model, tokenizer, [prompt], [stop], max_new_tokens=6)
    assert text == tokenizer.decode(free[:first], skip_special_tokens=True) != tokenizer.decode(free)


@pytest.mark.parametrize("prediction, reference, right", [
    ("so 3 + 4 = 7 apples\n#### 1,234", "#### 1234", True),
    ("#### 72\n\nQuestion: how many more?\n#### 9", "#### 72", True),  # the first #### answers
    ("The answer is 12", "#### 12", False),  # no ####: no answer, as the RFT verifier reads it
])
def test_instruction_eval_grades_gsm8k_as_the_rft_verifier_does(monkeypatch, prediction, reference, right):
    model, tokenizer = pretrained.load("tiny-llama")
    monkeypatch.setattr(instruction_eval, "greedy_continuations", lambda *args, **kwargs: [prediction])
    metrics, _ = instruction_eval.evaluate_instructions(model, tokenizer, [Example("2 + 2?", (), (), (reference,))],
                                                        stop_ids=[tokenizer.eos_token_id], max_new_tokens=4)
    verifier = Verifier(make_extractor("gsm8k"))
    assert metrics["accuracy"] == float(right) == float(verifier.judge([prediction], reference)[0])


# ----------------------------------------------------------------------------- end to end on GSM8K

@pytest.mark.slow
def test_a_chat_model_trains_on_gsm8k_as_messages_prompt_completion_and_renamed_csv(glue_data, tmp_path):
    rows = gsm8k_rows(glue_data, 48)
    with open(tmp_path / "messages.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                             {"role": "assistant", "content": r["answer"]}]}) + "\n")
    with open(tmp_path / "pc.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["question"], "completion": r["answer"]}) + "\n")
    with open(tmp_path / "qa.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    runs = {"messages": dict(train_file=str(tmp_path / "messages.jsonl")),
            "pc": dict(train_file=str(tmp_path / "pc.jsonl")),
            "csv": dict(train_file=str(tmp_path / "qa.csv"), columns="prompt=question,completion=answer")}
    for name, data in runs.items():
        out = tmp_path / name
        results = sft.run(Config(model_name="tiny-llama-chat", task_name="custom", method="lora", num_train=40,
                                   num_dev=4, num_eval=4, learning_rate=1e-2, max_steps=16, logging_steps=1,
                                   per_device_train_batch_size=4, max_length=256, max_new_tokens=4,
                                   output_dir=str(out), device="cpu", save_strategy="no", **data))
        losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r and "step" in r]
        assert all(math.isfinite(x) for x in losses), name
        assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, (name, losses)
        assert math.isfinite(results["loss"]) and results["perplexity"] == pytest.approx(math.exp(results["loss"]))
        predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
        assert len(predictions) == 4 and all(p["reference"].rsplit("#### ", 1)[1] for p in predictions)
    final = tmp_path / "messages" / "final"  # the adapter with its tokenizer, chat template and model card
    assert AutoTokenizer.from_pretrained(final).chat_template == pretrained.ZEPHYR_CHAT_TEMPLATE
    card = (final / "README.md").read_text()
    assert "base_model: tiny-llama-chat" in card and "| loss |" in card
    assert f'load_for_inference("{final}")' in card  # a built-in base: PEFT's own loader cannot find it
    peft_model = PeftModel.from_pretrained(pretrained.load("tiny-llama-chat")[0], final)
    assert sum("lora_A" in n for n, _ in peft_model.named_parameters()) == 4  # q, v of two layers


@pytest.mark.parametrize("name", ["chat.yaml", "text.yaml", "gsm8k_prompt_completion.yaml"])
def test_the_example_configs_run(glue_data, tmp_path, monkeypatch, name):
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the examples' paths are relative to the checkout, as their commands are run
    values = parsing.read_yaml(Config, str(root / "examples" / "sft" / name))
    if "gsm8k" in values["train_file"]:
        values.update(train_file=str(glue_data / "gsm8k" / "train.jsonl"),
                      eval_file=str(glue_data / "gsm8k" / "test.jsonl"), num_train=16, num_dev=2, num_eval=2)
    values.update(output_dir=str(tmp_path / "out"), max_steps=2, eval_steps=1, save_steps=1, max_new_tokens=4,
                  max_length=128, device="cpu")
    results = sft.run(Config(**values))
    assert results["steps"] == 2 and math.isfinite(results["dev_loss"])  # your own rows: a dev split, no eval carved


def test_the_best_checkpoint_of_instruction_data_has_the_lowest_dev_loss(glue_data, tmp_path):
    from xgblora import checkpoint

    rows = gsm8k_rows(glue_data, 40)
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps({"prompt": r["question"], "completion": r["answer"]}) + "\n"
                                               for r in rows))
    out = tmp_path / "run"
    sft.run(Config(model_name="tiny-llama-chat", task_name="custom", train_file=str(tmp_path / "pc.jsonl"),
                     method="lora", num_train=32, num_dev=4, num_eval=2, learning_rate=3e-2, max_steps=8,
                     per_device_train_batch_size=4, max_length=128, max_new_tokens=2, evaluation_strategy="steps",
                     eval_steps=2, save_steps=2, load_best_model_at_end=True, output_dir=str(out), device="cpu"))
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert [s for s, _ in evals] == [2, 4, 6, 8] and len({v for _, v in evals}) == 4
    best_step, best_loss = min(evals, key=lambda e: e[1])
    _, state, _ = checkpoint.read_checkpoint(out / "checkpoints" / "best")
    assert state["best"] == {"value": best_loss, "score": -best_loss, "step": best_step}
