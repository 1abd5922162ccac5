"""Task templates, verbalizers and labels on real GLUE/SuperGLUE rows, HF-layout rows and custom tasks."""

from collections import Counter

import pytest

from xgblora.config import Config
from xgblora.data.sources import read_jsonl
from xgblora.data.splits import load_rows
from xgblora.data.tasks import TASKS, CustomTask, Example, get_task
from xgblora.errors import UserError


def row_at(data_dir, task: str, split: str, line: int) -> dict:
    """The row on a given line of a task's file."""
    return dict(read_jsonl(data_dir / task / f"{split}.jsonl"))[line]


# One real row per task (file, line) and the exact example MeZO's template makes of it.
REAL_ROWS = [
    ("sst2", "dev", 7, Example("a sometimes tedious film . It was", (" terrible", " great"), (0,),
                               sfc_prompt=" It was")),
    ("rte", "dev", 59, Example(
        "Primary prevention of Alzheimer's disease is not possible at present.\n"
        "Does this mean that \"Alzheimer's disease is treated using drugs.\" is true? Yes or No?\n",
        ("Yes", "No"), (1,), sfc_prompt="Yes or No?\n")),
    ("cb", "dev", 15, Example(
        "Suppose A: Your turn. B: Okay. Uh, I don't think they should abolish it. "
        "Can we infer that \"they should abolish it\"? Yes, No, or Maybe?\n",
        ("Yes", "No", "Maybe"), (1,), sfc_prompt="Yes, No, or Maybe?\n")),
    ("boolq", "dev", 9, Example(
        "American entry into Canada by land -- Persons driving into Canada must have their vehicle's "
        "registration document and proof of insurance. Can u drive in canada with us license?\n",
        ("Yes", "No"), (0,), sfc_prompt="?\n")),
    ("copa", "dev", 33, Example("I coughed because", (" I inhaled smoke.", " I lowered my voice."), (0,),
                                sfc_prompt="because")),
    ("copa", "train", 13, Example("The pond froze over for the winter so",
                                  (" people skated on the pond.", " people brought boats to the pond."), (0,),
                                  sfc_prompt="so")),
    ("wic", "dev", 18, Example(
        'Does the word "hail" have the same meaning in these two sentences? Yes, No?\n'
        "Hail a cab.\nHe was hailed as a hero.\n", ("No", "Yes"), (1,), sfc_prompt="Yes, No?\n")),
    ("wsc", "dev", 47, Example(
        "Jane gave Joan candy because she was hungry.\n"
        'In the previous sentence, does the pronoun "she" refer to Joan? Yes or No?\n',
        ("No", "Yes"), (1,), sfc_prompt="Yes or No?\n")),
]


@pytest.mark.parametrize(("task", "split", "line", "expected"), REAL_ROWS, ids=lambda v: str(v)[:12])
def test_template_on_a_real_row(real_data, task, split, line, expected):
    assert get_task(task).examples(row_at(real_data, task, split, line), ("x", line)) == [expected]


def test_multirc_paragraph_gives_one_example_per_answer(real_data):
    row = row_at(real_data, "multirc", "dev", 37)
    examples = get_task("MultiRC").examples(row, ("x", 37))
    answers = [(q, a) for q in row["passage"]["questions"] for a in q["answers"]]
    assert len(examples) == len(answers) > 1
    first = examples[0]
    assert first.prompt.startswith("Susan wanted to have a birthday party. She called all of her friends.")
    assert first.prompt.endswith("Susan was happy and sent each friend a thank you card the next week. \n"
                                 "Question: Did Susan's sick friend recover?\n"
                                 'I found this answer "Yes,she recovered". Is that correct? Yes or No?\n')
    assert (first.candidates, first.gold, first.sfc_prompt) == (("No", "Yes"), (1,), "Yes or No?\n")
    assert [ex.gold[0] for ex in examples] == [a["label"] for _, a in answers]


# Example counts (answers for MultiRC) and gold-index distributions of the README.
README_COUNTS = {
    ("sst2", "train"): {0: 2242, 1: 2758}, ("sst2", "eval"): {0: 428, 1: 444},
    ("rte", "train"): {0: 1249, 1: 1241}, ("rte", "eval"): {0: 146, 1: 131},
    ("cb", "train"): {0: 115, 1: 119, 2: 16}, ("cb", "eval"): {0: 23, 1: 28, 2: 5},
    ("boolq", "train"): {0: 18, 1: 14}, ("boolq", "eval"): {0: 2033, 1: 1237},  # Yes (true) is candidate 0
    ("copa", "train"): {0: 195, 1: 205}, ("copa", "eval"): {0: 55, 1: 45},
    ("wic", "train"): {0: 2507, 1: 2493}, ("wic", "eval"): {0: 319, 1: 319},
    ("wsc", "train"): {0: 295, 1: 259}, ("wsc", "eval"): {0: 66, 1: 38},
    ("multirc", "train"): {0: 15218, 1: 12025}, ("multirc", "eval"): {0: 2773, 1: 2075},
}


@pytest.mark.parametrize(("task", "split"), list(README_COUNTS))
def test_counts_and_labels_match_readme(real_data, task, split):
    examples = load_rows(get_task(task), split, str(real_data))
    assert Counter(ex.gold[0] for ex in examples) == README_COUNTS[task, split]
    assert all(len(ex.gold) == 1 and 0 <= ex.gold[0] < len(ex.candidates) for ex in examples)
    assert all(ex.prompt.strip() and all(ex.candidates) for ex in examples)


def test_multirc_and_rte_sizes(real_data):
    assert len(load_rows(get_task("multirc"), "eval", str(real_data))) == 4848
    assert len(load_rows(get_task("rte"), "eval", str(real_data))) == 277


@pytest.mark.parametrize(("name", "canonical"), [
    ("sst2", "SST2"), ("SST-2", "SST2"), ("sst_2", "SST2"), ("Copa", "Copa"), ("COPA", "Copa"),
    ("wic", "WIC"), ("WiC", "WIC"), ("boolq", "BoolQ"), ("multirc", "MultiRC"), ("record", "ReCoRD"),
    ("squad", "SQuAD"), ("DROP", "DROP"), ("cb", "CB"), ("RTE", "RTE"), ("wsc", "WSC"),
])
def test_get_task_names(name, canonical):
    assert get_task(name).name == canonical


def test_registry_attributes():
    assert list(TASKS) == ["SST2", "RTE", "CB", "BoolQ", "Copa", "WIC", "WSC", "MultiRC", "ReCoRD", "SQuAD",
                           "DROP"]
    assert get_task("sst2").hf_dataset == ("glue", "sst2")
    assert get_task("wsc").hf_dataset == ("super_glue", "wsc.fixed")
    assert get_task("boolq").hf_dataset == ("boolq", None)
    assert {get_task(n).hf_splits for n in TASKS} == {("train", "validation")}
    for name in TASKS:
        task = get_task(name)
        generation = name in ("SQuAD", "DROP")
        assert (task.metric, task.generation) == ("f1" if generation else "accuracy", generation)
        assert task.dir_name == name.lower()


def test_unknown_task_lists_the_choices():
    with pytest.raises(UserError) as err:
        get_task("sst5")
    assert str(err.value) == ("unknown task 'sst5': choose one of SST2, RTE, CB, BoolQ, Copa, WIC, WSC, "
                              "MultiRC, ReCoRD, SQuAD, DROP or custom")


# HF datasets give integer class ids, and some tasks other field layouts.
HF_ROWS = [
    ("RTE", {"premise": "P.", "hypothesis": "H.", "idx": 0, "label": 0}, "Yes"),
    ("RTE", {"premise": "P.", "hypothesis": "H.", "idx": 0, "label": 1}, "No"),
    ("CB", {"premise": "P.", "hypothesis": "H.", "idx": 0, "label": 2}, "Maybe"),
    ("BoolQ", {"question": "is it", "passage": "P.", "answer": True}, "Yes"),
    ("BoolQ", {"question": "is it", "passage": "P.", "answer": False}, "No"),
    ("WIC", {"word": "w", "sentence1": "a w", "sentence2": "b w", "idx": 0, "label": 1}, "Yes"),
    ("WSC", {"text": "A saw B. He ran.", "span1_index": 0, "span2_index": 3, "span1_text": "A",
             "span2_text": "He", "idx": 0, "label": 0}, "No"),
    ("MultiRC", {"paragraph": "P.", "question": "Q?", "answer": "A", "idx": {"paragraph": 0}, "label": 1},
     "Yes"),
    ("SST2", {"sentence": "fine ", "label": 1, "idx": 0}, " great"),
]


@pytest.mark.parametrize(("task", "row", "gold"), HF_ROWS)
def test_hf_layouts_and_integer_labels(task, row, gold):
    (ex,) = get_task(task).examples(row, ("hf", 0))
    assert ex.candidates[ex.gold[0]] == gold


def test_boolq_capitalises_the_question_and_adds_a_question_mark():
    row = {"question": "is it red", "passage": "It is red.", "label": True}
    (ex,) = get_task("BoolQ").examples(row, ("x", 1))
    assert ex.prompt == "It is red. Is it red?\n"


def test_multirc_html_markup_is_removed():
    row = {"paragraph": "<b>Sent 1: </b>A cat sat.<br><b>Sent 2: </b>It slept.<br>", "question": "Did it?",
           "answer": "Yes", "label": 1}
    (ex,) = get_task("MultiRC").examples(row, ("hf", 0))
    assert ex.prompt == ('A cat sat. It slept. \nQuestion: Did it?\nI found this answer "Yes". '
                         "Is that correct? Yes or No?\n")


def test_record_hf_row():
    row = {"passage": "Bob met Ann in Paris.\n@highlight\nBob is in Paris\n@highlight\nAnn too",
           "query": "@placeholder was glad to see @placeholder's friend there",
           "entities": ["Bob", "Ann", "Paris"],
           "answers": ["Ann"], "idx": {"passage": 0, "query": 0}}
    (ex,) = get_task("ReCoRD").examples(row, ("hf", 0))
    assert ex.prompt == "Bob met Ann in Paris.\n- Bob is in Paris\n- Ann too\n-"
    assert ex.candidates == (" Bob was glad to see Bob's friend there",
                             " Ann was glad to see Ann's friend there",
                             " Paris was glad to see Paris's friend there")
    assert ex.gold == (1,)
    assert ex.sfc_prompt == "-"
    row = {**row, "query": "She said @placeholder won", "answers": ["Bob", "Bob"]}
    (ex,) = get_task("ReCoRD").examples(row, ("hf", 0))
    assert ex.prompt.endswith("\n- She said") and ex.candidates[0] == " Bob won" and ex.gold == (0,)
    assert ex.sfc_prompt == "- She said"


def test_record_superglue_row_flattens_queries():
    text = "Bob met Ann.\n@highlight\nAnn smiled"
    row = {"passage": {"text": text, "entities": [{"start": 0, "end": 2}, {"start": 8, "end": 10},
                                                  {"start": 24, "end": 26}]},
           "qas": [{"query": "@placeholder was happy", "answers": [{"start": 8, "end": 10, "text": "Ann"}]},
                   {"query": "@placeholder came", "answers": [{"start": 0, "end": 2, "text": "Bob"}]}]}
    examples = get_task("record").examples(row, ("x", 1))
    assert [ex.candidates for ex in examples] == [(" Ann was happy", " Bob was happy"),
                                                  (" Ann came", " Bob came")]
    assert [ex.gold for ex in examples] == [(0,), (1,)]


def test_squad_and_drop_are_generation_tasks():
    squad = {"id": "1", "title": "Cats", "context": "Cats purr.", "question": " What do cats do? ",
             "answers": {"text": ["purr", "they purr"], "answer_start": [5, 0]}}
    (ex,) = get_task("squad").examples(squad, ("hf", 0))
    assert ex == Example("Title: Cats\nContext: Cats purr.\nQuestion: What do cats do?\nAnswer:", (), (),
                         answers=("purr", "they purr"), sfc_prompt="Answer:")
    drop = {"passage": "3 goals.", "question": "How many goals?",
            "answers_spans": {"spans": ["3"], "types": ["number"]}}
    (ex,) = get_task("drop").examples(drop, ("hf", 0))
    assert ex == Example("Passage: 3 goals.\nQuestion: How many goals?\nAnswer:", (), (), answers=("3",),
                         sfc_prompt="Answer:")


@pytest.mark.parametrize(("task", "row", "message"), [
    ("RTE", {"premise": "P", "hypothesis": "H", "label": "maybe"},
     'f.jsonl:3: field "label": \'maybe\' is not one of entailment, not_entailment'),
    ("RTE", {"premise": "P", "label": "entailment"}, 'f.jsonl:3: field "hypothesis": missing'),
    ("RTE", {"premise": 7, "hypothesis": "H", "label": 0},
     'f.jsonl:3: field "premise": expected a string, got int'),
    ("SST2", {"sentence": "  ", "label": 0}, 'f.jsonl:3: field "sentence": empty string'),
    ("SST2", {"sentence": "x", "label": 2}, 'f.jsonl:3: field "label": 2 is not one of 0, 1'),
    ("SST2", {"sentence": "x", "label": 0.5},
     'f.jsonl:3: field "label": expected a label (string, integer or boolean), got float'),
    ("WIC", {"word": "w", "sentence1": "a", "sentence2": "b", "label": None},
     'f.jsonl:3: field "label": expected a label (string, integer or boolean), got null'),
    ("Copa", {"premise": "P.", "choice1": "a", "choice2": "b", "question": "why", "label": 0},
     'f.jsonl:3: field "question": \'why\' is not one of cause, effect'),
    ("WSC", {"text": "t", "target": {"span1_text": "A"}, "label": True},
     'f.jsonl:3: field "target.span2_text": missing'),
    ("MultiRC", {"passage": {"text": "P", "questions": [
        {"question": "Q", "answers": [{"text": "", "label": 3}]}]}},
     'f.jsonl:3: field "passage.questions[0].answers[0].label": 3 is not one of 0, 1'),
    ("ReCoRD", {"passage": "P", "query": "no slot", "entities": ["A"], "answers": ["A"]},
     'f.jsonl:3: field "query": no "@placeholder" in the query'),
    ("ReCoRD", {"passage": "P", "query": "@placeholder", "entities": ["A"], "answers": ["B"]},
     'f.jsonl:3: field "answers": none of the answers is among the entities'),
    ("SQuAD", {"title": "T", "context": "C", "question": "Q", "answers": {"text": []}},
     'f.jsonl:3: field "answers.text": expected a non-empty list of strings, got an empty list'),
])
def test_row_errors_name_file_line_and_field(task, row, message):
    with pytest.raises(UserError) as err:
        get_task(task).examples(row, ("f.jsonl", 3))
    assert str(err.value) == message


def custom(**kw) -> CustomTask:
    """A custom task over a placeholder train file."""
    return get_task("custom", Config(task_name="custom", train_file="t.jsonl", **kw).data)


def test_custom_classification_task():
    task = custom(template="Review: {text} ({stars} stars)\nSentiment:", label_words="bad, good",
                  label_names="neg,pos")
    assert (task.metric, task.generation) == ("accuracy", False)
    (ex,) = task.examples({"text": "Nice.", "stars": "5", "label": "pos"}, ("t.jsonl", 1))
    assert ex == Example("Review: Nice. (5 stars)\nSentiment:", (" bad", " good"), (1,),
                         sfc_prompt=" stars)\nSentiment:")
    assert task.examples({"text": "x", "stars": "1", "label": 0}, ("t", 2))[0].gold == (0,)  # a class index
    plain = custom(template="{text} It was", label_words="terrible,great")  # label names 0, 1
    golds = [plain.examples({"text": "a", "label": label}, ("t", 1))[0].gold for label in (1, "0")]
    assert golds == [(1,), (0,)]
    assert plain.examples({"text": "a", "label": 1}, ("t", 1))[0].sfc_prompt == " It was"


def test_custom_instruction_task():
    task = custom()
    assert (task.metric, task.generation) == ("f1", True)
    expected = [Example("2+2=", (), (), answers=("4",), source="t:1")]
    assert task.examples({"prompt": "2+2=", "response": "4"}, ("t", 1)) == expected


@pytest.mark.parametrize(("kw", "message"), [
    ({"template": "{text} It was"},
     "--template and --label_words go together (custom classification needs both)"),
    ({"template": "It was", "label_words": "a,b"},
     "--template 'It was': no {field} slot; e.g. '{text} It was'"),
    ({"template": "{} It was", "label_words": "a,b"},
     "--template '{} It was': empty {} slot; name a field, e.g. {text}"),
    ({"template": "{text It was", "label_words": "a,b"},
     "--template '{text It was': expected '}' before end of string (write a literal brace twice)"),
    ({"template": "{text}", "label_words": "a,b", "label_names": "x"},
     "--label_names has 1 names but --label_words has 2 words; give one name per word, in the same order"),
    ({"template": "{text}", "label_words": "a,,b"}, "--label_words 'a,,b': empty label word"),
])
def test_custom_option_errors(kw, message):
    with pytest.raises(UserError) as err:
        custom(**kw)
    assert str(err.value) == message


def test_custom_needs_a_train_file():
    with pytest.raises(UserError, match="--train_file"):
        get_task("custom", Config(task_name="custom").data)
    with pytest.raises(UserError, match="--train_file"):
        get_task("custom")
