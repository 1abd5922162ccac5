"""JSONL reading, local / HF / custom sources, one-line errors for bad input, and MeZO's sampling protocol."""

import dataclasses
import json
import logging

import datasets
import numpy as np
import pytest

from xgblora.config import Config
from xgblora.data.sources import read_jsonl
from xgblora.data.splits import load_rows, sample_splits
from xgblora.data.tasks import get_task
from xgblora.errors import UserError
from xgblora.train.setup import describe_splits


def write(path, text: str | bytes) -> None:
    """Write text (UTF-8) or bytes, creating folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))


def jsonl(*rows) -> str:
    """JSONL text of rows."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def ids(examples) -> set[int]:
    """Identities of examples (they come from one pool, so equal texts stay distinct)."""
    return {id(ex) for ex in examples}


# ----------------------------------------------------------------------------- read_jsonl

def test_read_jsonl_numbers_lines_and_skips_blank_ones(tmp_path):
    # byte-order marks (the file's, and a joined file's), CRLF line ends, blank lines, and no final newline
    write(tmp_path / "f.jsonl", b'\xef\xbb\xbf{"a": 1}\r\n\n   \n\xef\xbb\xbf{"a": 2}\n{"a": "\xc3\xa9"}')
    assert read_jsonl(tmp_path / "f.jsonl") == [(1, {"a": 1}), (4, {"a": 2}), (5, {"a": "é"})]


# ----------------------------------------------------------------------------- local folders (malformed input: test_malformed_inputs.py)

RTE_OK = {"premise": "P.", "hypothesis": "H.", "label": "entailment"}
CUSTOM_CLS = dict(task_name="custom", template="{text} It was", label_words="terrible,great")


def test_superglue_download_layout_is_accepted(tmp_path):
    write(tmp_path / "RTE" / "val.jsonl", jsonl(RTE_OK))
    assert load_rows(get_task("rte"), "eval", str(tmp_path))[0].candidates == ("Yes", "No")


# ----------------------------------------------------------------------------- Hugging Face datasets

def test_hf_rows_flow_through(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([{"premise": f"P{i}.", "hypothesis": "H.", "idx": i, "label": i % 2}
                                           for i in range(3)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = load_rows(get_task("RTE"), "eval", None)
    assert calls == [("super_glue", "rte", "validation")]
    assert [ex.prompt.split("\n")[0] for ex in examples] == ["P0.", "P1.", "P2."]
    assert [ex.gold for ex in examples] == [(0,), (1,), (0,)]
    splits = sample_splits(get_task("RTE"), Config(task_name="RTE", num_train=2, num_dev=1, num_eval=2).data)
    assert (len(splits.train), len(splits.dev), len(splits.eval)) == (2, 1, 2)
    assert calls[1:] == [("super_glue", "rte", "train"), ("super_glue", "rte", "validation")]


def test_bad_hf_row_is_located(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: datasets.Dataset.from_list([{"sentence": "ok", "label": 0},
                                                                    {"sentence": "", "label": 1}]))
    with pytest.raises(UserError) as err:
        load_rows(get_task("sst2"), "train", None)
    assert str(err.value) == 'glue/sst2[train]:1: field "sentence": empty string'


def test_failing_hf_load_suggests_data_dir(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'boolq' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError) as err:
        load_rows(get_task("boolq"), "train", None)
    message = str(err.value)
    assert message.startswith("cannot load boolq [train] from Hugging Face datasets "
                              "(ConnectionError: Couldn't reach")
    assert "--data_dir DIR holding boolq/train.jsonl and boolq/dev.jsonl" in message
    assert "\n" not in message and "more detail" not in message


# ----------------------------------------------------------------------------- MeZO's sampling protocol

def mezo_sample_subset(pool: list, seed: int, num: int) -> list:
    """MeZO's sample_subset: `with temp_seed(seed): np.random.permutation(len)[:num]` (numpy's global RNG)."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        return [pool[i] for i in np.random.permutation(len(pool)).tolist()[:num]]
    finally:
        np.random.set_state(state)


def rte_cfg(data_dir, **kw) -> Config:
    """An RTE config over the data folder."""
    defaults = {"task_name": "RTE", "data_dir": str(data_dir), "num_train": 16, "num_dev": 8, "num_eval": 20}
    return Config(**{**defaults, **kw})


def test_sampling_reproduces_mezo(glue_data):
    task = get_task("RTE")
    splits = sample_splits(task, rte_cfg(glue_data, train_set_seed=3).data)
    drawn = mezo_sample_subset(load_rows(task, "train", str(glue_data)), 3, 16 + 8)
    assert (splits.train, splits.dev) == (drawn[:-8], drawn[-8:])  # run.py: dev = the last num_dev
    assert splits.eval == mezo_sample_subset(load_rows(task, "eval", str(glue_data)), 0, 20)


def test_sampling_is_deterministic_disjoint_and_seeded(glue_data):
    task = get_task("RTE")
    a, again = sample_splits(task, rte_cfg(glue_data).data), sample_splits(task, rte_cfg(glue_data).data)
    assert (a.train, a.dev, a.eval) == (again.train, again.dev, again.eval)
    assert (len(a.train), len(a.dev), len(a.eval)) == (16, 8, 20)
    assert not ids(a.train) & ids(a.dev)
    b = sample_splits(task, rte_cfg(glue_data, train_set_seed=1).data)
    assert a.train != b.train and a.dev != b.dev
    assert a.eval == b.eval  # eval is drawn with seed 0 whatever the train seed


def test_all_of_eval_in_order_without_num_eval(glue_data):
    task = get_task("sst2")
    splits = sample_splits(task, rte_cfg(glue_data, task_name="sst2", num_eval=None, num_dev=None).data)
    assert splits.eval == load_rows(task, "eval", str(glue_data))
    assert (len(splits.train), splits.dev) == (16, [])


def test_multirc_is_sampled_at_answer_level(glue_data):
    paragraphs = len(list(read_jsonl(glue_data / "multirc" / "dev.jsonl")))
    splits = sample_splits(get_task("MultiRC"), rte_cfg(glue_data, task_name="MultiRC", num_eval=40).data)
    assert paragraphs < 40 == len(splits.eval)
    assert len({ex.prompt for ex in splits.eval}) == 40  # answers of many paragraphs, not whole paragraphs


def test_boolq_shortfall_takes_all_and_warns_once(glue_data, caplog):
    cfg = rte_cfg(glue_data, task_name="BoolQ", num_train=48, num_dev=16, num_eval=None)
    with caplog.at_level(logging.WARNING, logger="xgblora"):
        splits = sample_splits(get_task("BoolQ"), cfg.data)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "BoolQ: asked for 48 train + 16 dev examples but the train split has 16; using 12 train + 4 dev"]
    evaluated = len(list(read_jsonl(glue_data / "boolq" / "dev.jsonl")))
    assert (len(splits.train), len(splits.dev), len(splits.eval)) == (12, 4, evaluated)
    assert len(ids(splits.train) | ids(splits.dev)) == 16


def test_eval_shortfall_warns(glue_data, caplog):
    with caplog.at_level(logging.WARNING, logger="xgblora"):
        splits = sample_splits(get_task("CB"), rte_cfg(glue_data, task_name="CB", num_eval=500).data)
    rows = len(list(read_jsonl(glue_data / "cb" / "dev.jsonl")))
    assert f"CB: asked for 500 eval examples but there are {rows}; using all {rows}" in caplog.text
    assert len(splits.eval) == rows


def test_zero_shot_does_not_read_the_train_split(tmp_path):
    write(tmp_path / "rte" / "dev.jsonl", jsonl(RTE_OK, RTE_OK))
    splits = sample_splits(get_task("rte"), rte_cfg(tmp_path, num_train=0, num_dev=None, num_eval=None).data)
    assert (splits.train, splits.dev, len(splits.eval)) == ([], [], 2)


# ----------------------------------------------------------------------------- custom tasks

def test_custom_classification_with_eval_file(tmp_path):
    write(tmp_path / "train.jsonl", jsonl(*({"text": f"t{i}", "label": i % 2} for i in range(20))))
    write(tmp_path / "eval.jsonl", jsonl({"text": "e0", "label": "1"}, {"text": "e1", "label": 0}))
    cfg = Config(**CUSTOM_CLS, train_file=str(tmp_path / "train.jsonl"),
                 eval_file=str(tmp_path / "eval.jsonl"), num_train=8, num_dev=4)
    splits = sample_splits(get_task("custom", cfg.data), cfg.data)
    assert (len(splits.train), len(splits.dev)) == (8, 4)
    assert [(ex.prompt, ex.candidates, ex.gold) for ex in splits.eval] == [
        ("e0 It was", (" terrible", " great"), (1,)), ("e1 It was", (" terrible", " great"), (0,))]


def test_custom_instruction_eval_drawn_from_train_file(tmp_path):
    write(tmp_path / "train.jsonl", jsonl(*({"prompt": f"q{i}", "response": f"a{i}"} for i in range(30))))
    cfg = Config(task_name="custom", train_file=str(tmp_path / "train.jsonl"), num_train=10, num_dev=5)
    task = get_task("custom", cfg.data)
    splits = sample_splits(task, cfg.data)
    assert (len(splits.train), len(splits.dev), len(splits.eval)) == (10, 5, 15)
    prompts = [[ex.prompt for ex in part] for part in (splits.train, splits.dev, splits.eval)]
    assert sorted(sum(prompts, [])) == sorted(f"q{i}" for i in range(30))  # disjoint and complete
    assert prompts[2] == sorted(prompts[2], key=lambda p: int(p[1:]))  # eval in file order
    assert splits.eval[0].answers == (f"a{prompts[2][0][1:]}",) and splits.eval[0].candidates == ()
    cfg = dataclasses.replace(cfg, num_eval=4)
    assert len(sample_splits(task, cfg.data).eval) == 4


def test_custom_without_eval_rows_left(tmp_path):
    write(tmp_path / "train.jsonl", jsonl(*({"prompt": "q", "response": "a"} for _ in range(5))))
    cfg = Config(task_name="custom", train_file=str(tmp_path / "train.jsonl"), num_train=5)
    with pytest.raises(UserError, match="has 5 examples, not enough .* pass --eval_file or lower"):
        sample_splits(get_task("custom", cfg.data), cfg.data)


def test_dev_pool_sentences_keeps_the_train_draw_and_draws_dev_from_full_sentences(glue_data):
    from xgblora.data.splits import is_sentence

    common = dict(task_name="SST2", data_dir=str(glue_data), num_train=64, num_dev=20, train_set_seed=1)
    plain = sample_splits(get_task("SST2", Config(**common).data), Config(**common).data)
    cfg = Config(**common, dev_pool="sentences")
    splits = sample_splits(get_task("SST2", cfg.data), cfg.data)
    assert splits.train == plain.train and len(splits.dev) == 20
    assert all(len(ex.prompt.split()) >= 8 and any(m + " " in ex.prompt for m in ".!?") for ex in splits.dev)
    assert not {ex.prompt for ex in splits.dev} & {ex.prompt for ex in splits.train}
    assert sum(map(is_sentence, (ex.prompt for ex in plain.dev))) < 10  # a plain draw is mostly phrases
    assert not is_sentence("a gorgeous , witty , seductive movie . It was".replace(" . ", " "))


# ----------------------------------------------------------------------------- defaults of the user's own data

def _chat_rows(n):
    return ({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(n))


def test_own_data_trains_on_every_row_without_a_dev_split(tmp_path):
    write(tmp_path / "chat.jsonl", jsonl(*_chat_rows(171)))
    cfg = Config(task_name="custom", train_file=str(tmp_path / "chat.jsonl"))
    assert cfg.num_train is None  # MeZO's 1000 is for MeZO's tasks only
    task = get_task("custom", cfg.data)
    splits = sample_splits(task, cfg.data)
    assert (len(splits.train), splits.dev, splits.eval, splits.monitor) == (171, [], [], [])
    assert [ex.source for ex in splits.train] == [ex.source for ex in load_rows(task, "train", None)]  # every row
    assert describe_splits(task, cfg, splits) == (f"custom: training on all 171 examples of {tmp_path / 'chat.jsonl'}; "
                                           "no dev split; no evaluation set (pass --eval_file, --num_dev N or "
                                           "--eval_split_ratio R)")


def test_own_data_dev_split_only_when_asked(tmp_path):
    write(tmp_path / "chat.jsonl", jsonl(*_chat_rows(171)))
    for asked, n_dev in ({"eval_split_ratio": 0.1}, 17), ({"num_dev": 20}, 20):
        cfg = Config(task_name="custom", train_file=str(tmp_path / "chat.jsonl"), **asked)
        splits = sample_splits(get_task("custom", cfg.data), cfg.data)
        assert (len(splits.train), len(splits.dev)) == (171 - n_dev, n_dev)
        assert not {ex.source for ex in splits.train} & {ex.source for ex in splits.dev}
        assert splits.monitor == splits.dev


def test_own_eval_file_is_watched_when_there_is_no_dev_split(tmp_path):
    write(tmp_path / "chat.jsonl", jsonl(*_chat_rows(30)))
    write(tmp_path / "eval.jsonl", jsonl(*_chat_rows(4)))
    cfg = Config(task_name="custom", train_file=str(tmp_path / "chat.jsonl"), eval_file=str(tmp_path / "eval.jsonl"),
                 evaluation_strategy="steps", eval_steps=50)
    task = get_task("custom", cfg.data)
    splits = sample_splits(task, cfg.data)
    assert (len(splits.train), splits.dev, len(splits.eval)) == (30, [], 4)
    assert splits.monitor == splits.eval
    assert describe_splits(task, cfg, splits).endswith(f"no dev split; evaluating on 4 examples of {tmp_path / 'eval.jsonl'} "
                                                f"every 50 steps and at the end")


def test_mezo_tasks_keep_their_protocol_defaults():
    assert Config(task_name="SST2").num_train == 1000
    assert Config(task_name="SST2", num_dev=500).num_dev == 500
    with pytest.raises(UserError, match="--eval_split_ratio holds out a share of your own --train_file"):
        Config(task_name="SST2", eval_split_ratio=0.1)
    with pytest.raises(UserError, match="--num_dev and --eval_split_ratio both"):
        Config(task_name="custom", train_file="x.jsonl", num_dev=3, eval_split_ratio=0.1)
