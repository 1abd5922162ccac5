"""Task registry: MeZO's templates and verbalizers, each task's metric, row validation; custom JSONL tasks."""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from typing import Any

from xgblora.config import DataOptions
from xgblora.data.sources import Where, parse_columns
from xgblora.errors import UserError, located


@dataclass(frozen=True)
class Example:
    """One prompt and the continuations scored after it (or the reference answers of a generation task)."""

    prompt: str  # templated text that every candidate continues
    candidates: tuple[str, ...]  # continuations scored after the prompt (full text = prompt + candidate)
    gold: tuple[int, ...]  # index(es) of the correct candidate(s); () for generation tasks
    answers: tuple[str, ...] = ()  # reference strings for generation tasks (F1/EM); () otherwise
    sfc_prompt: str = ""  # SFC calibration prompt: the template with the input left out
    messages: tuple[tuple[str, str], ...] = ()  # a conversation as (role, content) turns, rendered by a chat template
    trained_from: int = 0  # the first message whose assistant turns carry loss (TRL's conversational completion)
    labels: tuple[float, ...] = ()  # a reranker row's relevance label of each candidate passage; () otherwise
    source: str = ""  # where the row came from, for errors found after loading ("train.jsonl:3")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _label_key(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _finite(fields: Fields, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        shown = repr(value) if isinstance(value, str | float) else _type_name(value)
        raise fields.error(key, f"expected a number, got {shown}")
    return float(value)


class Fields:
    """A row being read: typed getters that raise one-line UserErrors naming the file, line and field."""

    def __init__(self, row: dict[str, Any], where: Where, prefix: str = "", mappable: bool = False):
        self.row, self.where, self.prefix = row, where, prefix
        self.mappable = mappable  # the user's own data: a missing field may be their column under another name

    @property
    def source(self) -> str:
        """Where the row came from, for errors found after loading: 'file:line' or 'file, row N'."""
        path, line = self.where
        return f"{path}:{line}" if isinstance(line, int) else f"{path}, {line}"

    def error(self, key: str, what: str) -> UserError:
        """A UserError about field `key` of this row."""
        return located(self.where[0], self.where[1], self.prefix + key, what)

    def has(self, key: str) -> bool:
        """Whether the row holds the field."""
        return key in self.row

    def get(self, key: str) -> Any:
        """The raw value of a field that must be present."""
        if key not in self.row:
            if self.prefix or not self.mappable:
                raise self.error(key, "missing")
            raise self.error(key, f"missing; the row has: {', '.join(map(str, self.row)) or 'no fields'} "
                                  f"(--columns {key}=YOURS maps your column to it)")
        return self.row[key]

    def text(self, key: str, allow_empty: bool = False) -> str:
        """A string field (non-blank unless allow_empty)."""
        value = self.get(key)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {_type_name(value)}")
        if not allow_empty and not value.strip():
            raise self.error(key, "empty string")
        return value

    def texts(self, key: str) -> list[str]:
        """A non-empty list of non-blank strings."""
        value = self.get(key)
        if not isinstance(value, list) or not value:
            raise self.error(key, "expected a non-empty list of strings, got "
                             + ("an empty list" if value == [] else _type_name(value)))
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item.strip():
                raise self.error(f"{key}[{i}]", "empty string" if isinstance(item, str)
                                 else f"expected a string, got {_type_name(item)}")
        return value

    def integer(self, key: str) -> int:
        """An integer field."""
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"expected an integer, got {_type_name(value)}")
        return value

    def number(self, key: str) -> float:
        """A finite number (an integer or a float; not a boolean or a string)."""
        return _finite(self, key, self.get(key))

    def numbers(self, key: str) -> list[float]:
        """A non-empty list of finite numbers."""
        value = self.get(key)
        if not isinstance(value, list) or not value:
            raise self.error(key, "expected a non-empty list of numbers, got "
                             + ("an empty list" if value == [] else _type_name(value)))
        return [_finite(self, f"{key}[{i}]", item) for i, item in enumerate(value)]

    def label(self, key: str, labels: tuple[Any, ...]) -> int:
        """Index of the field's value in labels; strings, booleans or integers (HF class ids) are accepted."""
        value = self.get(key)
        if not isinstance(value, (str, int)):
            raise self.error(key, f"expected a label (string, integer or boolean), got {_type_name(value)}")
        keys = [_label_key(x) for x in labels]
        if _label_key(value) in keys:
            return keys.index(_label_key(value))
        if isinstance(value, int) and not isinstance(value, bool):
            if all(isinstance(x, bool) for x in labels) and value in (0, 1):  # HF stores booleans as 0 / 1
                return keys.index(_label_key(bool(value)))
            if not any(k.lstrip("-").isdigit() for k in keys) and 0 <= value < len(labels):  # HF class id
                return value
        raise self.error(key, f"{value!r} is not one of {', '.join(keys)}")

    def obj(self, key: str) -> Fields:
        """A nested JSON object."""
        value = self.get(key)
        if not isinstance(value, dict):
            raise self.error(key, f"expected an object, got {_type_name(value)}")
        return Fields(value, self.where, f"{self.prefix}{key}.")

    def objs(self, key: str) -> list[Fields]:
        """A list of nested JSON objects."""
        value = self.get(key)
        if not isinstance(value, list):
            raise self.error(key, f"expected a list, got {_type_name(value)}")
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise self.error(f"{key}[{i}]", f"expected an object, got {_type_name(item)}")
            out.append(Fields(item, self.where, f"{self.prefix}{key}[{i}]."))
        return out


class Task:
    """A task: where its data lives, how one row becomes examples, and how predictions are scored."""

    name: str  # MeZO's task name
    dir_name: str  # folder under --data_dir
    metric: str = "accuracy"
    generation: bool = False
    instruction: bool = False  # the user's instruction data: EOS in every target, chat templates, token-mean loss
    hf_dataset: tuple[str, str | None]  # datasets.load_dataset(path, name) as MeZO calls it
    hf_splits: tuple[str, str] = ("train", "validation")
    own_rows: bool = False  # rows of the user's own files, whose columns --columns maps

    def examples(self, row: dict[str, Any], where: Where) -> list[Example]:
        """Validate one row and turn it into examples (several for MultiRC paragraphs, SuperGLUE ReCoRD)."""
        return self.build(Fields(row, where, mappable=self.own_rows))

    def build(self, r: Fields) -> list[Example]:
        """Template one validated row (each task overrides this)."""
        raise NotImplementedError


# ---------------------------------------------------------------- MeZO's tasks (large_models/templates.py)

class SST2(Task):
    name, dir_name, hf_dataset = "SST2", "sst2", ("glue", "sst2")

    def build(self, r: Fields) -> list[Example]:
        text = r.text("sentence").strip()
        gold = r.label("label", (0, 1))
        return [Example(f"{text} It was", (" terrible", " great"), (gold,), sfc_prompt=" It was")]


# MeZO calibrates the Yes/No tasks with an empty prompt, which leaves the first answer token without context
# unless the tokenizer prepends BOS; we keep the template's closing cue (e.g. "Yes or No?\n") instead.

class RTE(Task):
    name, dir_name, hf_dataset = "RTE", "rte", ("super_glue", "rte")

    def build(self, r: Fields) -> list[Example]:
        premise, hypothesis = r.text("premise"), r.text("hypothesis")
        gold = r.label("label", ("entailment", "not_entailment"))
        prompt = f'{premise}\nDoes this mean that "{hypothesis}" is true? Yes or No?\n'
        return [Example(prompt, ("Yes", "No"), (gold,), sfc_prompt="Yes or No?\n")]


class CB(Task):
    name, dir_name, hf_dataset = "CB", "cb", ("super_glue", "cb")

    def build(self, r: Fields) -> list[Example]:
        premise, hypothesis = r.text("premise"), r.text("hypothesis")
        gold = r.label("label", ("entailment", "contradiction", "neutral"))
        prompt = f'Suppose {premise} Can we infer that "{hypothesis}"? Yes, No, or Maybe?\n'
        return [Example(prompt, ("Yes", "No", "Maybe"), (gold,), sfc_prompt="Yes, No, or Maybe?\n")]


class BoolQ(Task):
    # MeZO loads the standalone "boolq" dataset (label field "answer") with its BoolQTemplateV3.
    name, dir_name, hf_dataset = "BoolQ", "boolq", ("boolq", None)

    def build(self, r: Fields) -> list[Example]:
        passage, question = r.text("passage"), r.text("question")
        question = question if question.endswith("?") else question + "?"
        question = question[0].upper() + question[1:]
        gold = r.label("answer" if r.has("answer") and not r.has("label") else "label", (True, False))
        return [Example(f"{passage} {question}\n", ("Yes", "No"), (gold,), sfc_prompt="?\n")]


class Copa(Task):
    name, dir_name, hf_dataset = "Copa", "copa", ("super_glue", "copa")

    @staticmethod
    def _lower_first(choice: str) -> str:
        words = choice.split(" ")
        if words[0] != "I":
            words[0] = words[0].lower()
        return " ".join(words)

    def build(self, r: Fields) -> list[Example]:
        premise = r.text("premise").rstrip()
        premise = premise[:-1] if premise.endswith(".") else premise
        conjunction = ("because", "so")[r.label("question", ("cause", "effect"))]
        choices = (" " + self._lower_first(r.text("choice1")), " " + self._lower_first(r.text("choice2")))
        gold = r.label("label", (0, 1))
        return [Example(f"{premise} {conjunction}", choices, (gold,), sfc_prompt=conjunction)]


class WIC(Task):
    name, dir_name, hf_dataset = "WIC", "wic", ("super_glue", "wic")

    def build(self, r: Fields) -> list[Example]:
        word, sent1, sent2 = r.text("word"), r.text("sentence1"), r.text("sentence2")
        prompt = (f'Does the word "{word}" have the same meaning in these two sentences? Yes, No?\n'
                  f"{sent1}\n{sent2}\n")
        return [Example(prompt, ("No", "Yes"), (r.label("label", (False, True)),), sfc_prompt="Yes, No?\n")]


class WSC(Task):
    # SuperGLUE files nest the spans under "target"; HF's wsc.fixed has them at the top level.
    name, dir_name, hf_dataset = "WSC", "wsc", ("super_glue", "wsc.fixed")

    def build(self, r: Fields) -> list[Example]:
        text = r.text("text")
        spans = r.obj("target") if r.has("target") else r
        span1, span2 = spans.text("span1_text"), spans.text("span2_text")
        prompt = (f'{text}\nIn the previous sentence, does the pronoun "{span2.lower()}" refer to {span1}? '
                  "Yes or No?\n")
        return [Example(prompt, ("No", "Yes"), (r.label("label", (False, True)),), sfc_prompt="Yes or No?\n")]


class MultiRC(Task):
    # SuperGLUE files hold one paragraph per line with its questions and answers nested; HF rows are one
    # answer each (paragraph, question, answer). Both give one Example per answer, in file order. Answer
    # texts may be empty: three are in the official train split.
    name, dir_name, hf_dataset = "MultiRC", "multirc", ("super_glue", "multirc")
    _SENT_MARK, _BREAK = re.compile(r"<b>Sent \d+: </b>"), re.compile(r"<br\s*/?>")  # older releases' markup

    @classmethod
    def paragraph_text(cls, paragraph: str) -> str:
        """A paragraph without the sentence marks and line breaks of older releases' markup."""
        return cls._BREAK.sub(" ", cls._SENT_MARK.sub("", paragraph))

    def _example(self, paragraph: str, question: str, answer: str, gold: int) -> Example:
        paragraph = self.paragraph_text(paragraph)
        prompt = (f'{paragraph}\nQuestion: {question}\nI found this answer "{answer}". Is that correct? '
                  "Yes or No?\n")
        return Example(prompt, ("No", "Yes"), (gold,), sfc_prompt="Yes or No?\n")

    def build(self, r: Fields) -> list[Example]:
        if r.has("paragraph"):
            return [self._example(r.text("paragraph"), r.text("question"), r.text("answer", allow_empty=True),
                                  r.label("label", (0, 1)))]
        passage = r.obj("passage")
        paragraph = passage.text("text")
        return [self._example(paragraph, q.text("question"), a.text("text", allow_empty=True),
                              a.label("label", (0, 1)))
                for q in passage.objs("questions") for a in q.objs("answers")]


class ReCoRD(Task):
    # MeZO's ReCoRDTemplateGPT3: highlights as "- " lines, then "- " + the query with an entity in the
    # placeholder. The query text before "@placeholder" is part of the prompt; each candidate is an entity
    # plus the rest of the query.
    name, dir_name, hf_dataset = "ReCoRD", "record", ("super_glue", "record")

    @staticmethod
    def _example(r: Fields, passage: str, query: str, entities: list[str], answers: list[str]) -> Example:
        if "@placeholder" not in query:
            raise r.error("query", 'no "@placeholder" in the query')
        entities = list(dict.fromkeys(entities))
        gold = tuple(i for i, entity in enumerate(entities) if entity in answers)
        if not gold:
            raise r.error("answers", "none of the answers is among the entities")
        head, rest = query.split("@placeholder", 1)
        head = passage.replace("@highlight\n", "- ") + "\n- " + head
        prompt = head.rstrip()
        gap = head[len(prompt):]  # the space before the entity goes with it (one BPE token with the word)
        candidates = tuple(gap + entity + rest.replace("@placeholder", entity) for entity in entities)
        return Example(prompt, candidates, gold, sfc_prompt=prompt[prompt.rfind("\n") + 1:])

    def build(self, r: Fields) -> list[Example]:
        if r.has("passage") and isinstance(r.get("passage"), dict):  # SuperGLUE: entity spans, nested queries
            passage = r.obj("passage")
            text = passage.text("text")
            spans = [(e.integer("start"), e.integer("end")) for e in passage.objs("entities")]
            entities = sorted({text[start:end + 1] for start, end in spans})  # ends are inclusive; HF sorts
            examples = []
            for qa in r.objs("qas"):
                answers = [a.text("text") for a in qa.objs("answers")]
                examples.append(self._example(qa, text, qa.text("query"), entities, answers))
            return examples
        return [self._example(r, r.text("passage"), r.text("query"), r.texts("entities"), r.texts("answers"))]


class SQuAD(Task):
    name, dir_name, hf_dataset = "SQuAD", "squad", ("squad", None)
    metric, generation = "f1", True

    def build(self, r: Fields) -> list[Example]:
        title, context, question = r.text("title"), r.text("context"), r.text("question").strip()
        answers = tuple(r.obj("answers").texts("text"))
        prompt = f"Title: {title}\nContext: {context}\nQuestion: {question}\nAnswer:"
        return [Example(prompt, (), (), answers=answers, sfc_prompt="Answer:")]


class DROP(Task):
    name, dir_name, hf_dataset = "DROP", "drop", ("drop", None)
    metric, generation = "f1", True

    def build(self, r: Fields) -> list[Example]:
        passage, question = r.text("passage"), r.text("question").strip()
        answers = tuple(r.obj("answers_spans").texts("spans"))
        return [Example(f"Passage: {passage}\nQuestion: {question}\nAnswer:", (), (), answers=answers,
                        sfc_prompt="Answer:")]


# ----------------------------------------------------------------------------- custom JSONL tasks

class CustomTask(Task):
    """A task from the user's data: classification (template + label words) or instruction data (see `_instruction`)."""

    name, dir_name, hf_dataset = "custom", "custom", ("json", None)  # read from train_file / eval_file
    own_rows = True

    def __init__(self, cfg: DataOptions):
        if not cfg.train_file and not (cfg.evaluation_only and cfg.eval_file):
            raise UserError("task 'custom' needs --train_file: with --template and --label_words for classification, "
                            'else instruction rows ({"messages": [...]}, {"prompt": ..., "completion": ...} or '
                            '{"text": ...})')
        if bool(cfg.template) != bool(cfg.label_words):
            raise UserError("--template and --label_words go together (custom classification needs both)")
        self.train_file, self.eval_file = cfg.train_file, cfg.eval_file
        self.columns = parse_columns(cfg.columns)
        self.generation = self.instruction = not cfg.template
        self.data_format = cfg.data_format
        self.metric = "f1" if self.generation else "accuracy"
        if cfg.template:
            self._set_classification(cfg)

    def _set_classification(self, cfg: DataOptions) -> None:
        self.pieces = self._parse_template(cfg.template)
        last_slot = max(i for i, (_, slot) in enumerate(self.pieces) if slot is not None)
        self.sfc_prompt = "".join(literal for literal, _ in self.pieces[last_slot + 1:])  # after the input
        self.words = tuple(w.strip() for w in cfg.label_words.split(","))
        self.label_names = (tuple(n.strip() for n in cfg.label_names.split(",")) if cfg.label_names
                            else tuple(str(i) for i in range(len(self.words))))
        if not all(self.words):
            raise UserError(f"--label_words {cfg.label_words!r}: empty label word")
        if len(self.label_names) != len(self.words):
            raise UserError(f"--label_names has {len(self.label_names)} names but --label_words has "
                            f"{len(self.words)} words; give one name per word, in the same order")

    @staticmethod
    def _parse_template(template: str) -> list[tuple[str, str | None]]:
        try:
            pieces = [(literal, slot) for literal, slot, _, _ in string.Formatter().parse(template)]
        except ValueError as exc:
            raise UserError(f"--template {template!r}: {exc} (write a literal brace twice)") from None
        if any(slot == "" for _, slot in pieces):
            raise UserError(f"--template {template!r}: empty {{}} slot; name a field, e.g. {{text}}")
        if all(slot is None for _, slot in pieces):
            raise UserError(f"--template {template!r}: no {{field}} slot; e.g. '{{text}} It was'")
        return pieces

    def build(self, r: Fields) -> list[Example]:
        if self.generation:
            return [self._instruction(r)]
        prompt = "".join(literal + (r.text(slot) if slot is not None else "")
                         for literal, slot in self.pieces)
        gold = r.label("label", self.label_names)
        return [Example(prompt, tuple(" " + w for w in self.words), (gold,), sfc_prompt=self.sfc_prompt)]

    def _instruction(self, r: Fields) -> Example:
        """A `messages` conversation, a prompt/completion pair (TRL's; `response` stands for `completion`; lists
        of messages make it a conversation trained on the completion's turns), or a `text` row."""
        fmt = self.data_format if self.data_format != "auto" else _detect_format(r)
        source = r.source
        if fmt == "text":
            return Example("", (), (), answers=(r.text("text"),), source=source)
        if fmt == "messages":
            return _conversation(_messages(r, "messages"), 0, r, "messages", source)
        answer_key = "response" if r.has("response") and not r.has("completion") else "completion"
        if isinstance(r.get("prompt"), list):
            prompt = _messages(r, "prompt")
            return _conversation(prompt + _messages(r, answer_key), len(prompt), r, answer_key, source)
        return Example(r.text("prompt"), (), (), answers=(r.text(answer_key),), source=source)


def _detect_format(r: Fields) -> str:
    for key, fmt in (("messages", "messages"), ("prompt", "prompt_completion"), ("text", "text")):
        if r.has(key):
            return fmt
    raise r.error("messages", f'missing: instruction rows hold "messages", "prompt" and "completion" (or '
                  f'"response"), or "text" (--columns maps other names); the row has: {", ".join(r.row) or "no fields"}')


# The roles chat templates know (transformers' convention). A template renders another one in its own way (as
# written, as some other role, or not at all), so a turn of role "wizard" would train as whatever came out.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def role_problem(role: str) -> str | None:
    """What is wrong with a chat turn's role (the error's text), or None for one of CHAT_ROLES."""
    return None if role in CHAT_ROLES else f"{role!r} is not a chat role; use one of {', '.join(CHAT_ROLES)}"


def _messages(r: Fields, key: str) -> list[tuple[str, str]]:
    turns = r.objs(key)
    if not turns:
        raise r.error(key, "empty list of messages")
    for turn in turns:
        if problem := role_problem(turn.text("role")):
            raise turn.error("role", problem)
    return [(turn.text("role"), turn.text("content", allow_empty=True)) for turn in turns]


def _conversation(messages: list[tuple[str, str]], trained_from: int, r: Fields, key: str, source: str) -> Example:
    """An Example of chat turns; its reference answer (for evaluation) is the last assistant turn."""
    answers = [content for role, content in messages[trained_from:] if role == "assistant"]
    if not answers:
        raise r.error(key, 'no message with role "assistant" to train on')
    return Example("", (), (), answers=(answers[-1],), messages=tuple(messages), trained_from=trained_from,
                   source=source)


class PromptTask(Task):
    """Prompts to generate from: a `prompt` (a string, or a list of messages) or a `messages` conversation; a
    reference answer, when the row has one, is kept for verification (`completion`, `response`, or a conversation's
    trailing assistant turn)."""

    name, dir_name, hf_dataset = "prompts", "prompts", ("json", None)
    own_rows = True

    def build(self, r: Fields) -> list[Example]:
        source = r.source
        answer_key = next((k for k in ("completion", "response") if r.has(k)), None)
        if r.has("messages") or (r.has("prompt") and isinstance(r.get("prompt"), list)):
            key = "messages" if r.has("messages") else "prompt"
            turns = _messages(r, key)
            if answer_key is not None:
                turns += [("assistant", r.text(answer_key))] if isinstance(r.get(answer_key), str) else _messages(r, answer_key)
            reference = turns.pop()[1] if turns[-1][0] == "assistant" else None
            if not turns:
                raise r.error(key, "no message before the assistant's answer")
            return [Example("", (), (), answers=(reference,) if reference else (), messages=tuple(turns),
                            source=source)]
        if not r.has("prompt"):
            raise r.error("prompt", 'missing: prompt rows hold "prompt" (a string or a list of messages) or "messages" '
                          f'(--columns maps other names); the row has: {", ".join(r.row) or "no fields"}')
        reference = (r.text(answer_key),) if answer_key is not None else ()
        return [Example(r.text("prompt"), (), (), answers=reference, source=source)]


TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (SST2, RTE, CB, BoolQ, Copa, WIC, WSC, MultiRC, ReCoRD, SQuAD, DROP)}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def get_task(name: str, cfg: DataOptions | None = None) -> Task:
    """The task called name (MeZO's or the folder's, any case, e.g. 'SST-2'); 'custom' is built from cfg."""
    if _key(name) == "custom":
        if cfg is None:
            raise UserError("task 'custom' is built from --train_file, --template and --label_words; "
                            "none were given")
        return CustomTask(cfg)
    for cls in TASKS.values():
        if _key(name) in (_key(cls.name), _key(cls.dir_name)):
            return cls()
    raise UserError(f"unknown task {name!r}: choose one of {', '.join(TASKS)} or custom")
