"""Pair data for embedding models: rows of a query, its positive document and optional hard negatives, read through
the same sources and one-line errors as every custom task; tokenised once and collated into `PairBatch`es.

A pair row is an `Example` whose prompt is the query and whose candidates are the positive then the negatives
(gold 0), so the train/dev/eval sampling of `data/loading.py` applies unchanged. Instruction prefixes (E5's
"query: ", GritLM's "<|user|>\n...\n<|embed|>\n") are added when tokenising, not stored in the examples.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from xgblora.config import DataOptions
from xgblora.data.batches import PairBatch
from xgblora.data.sources import parse_columns
from xgblora.data.tasks import CustomTask, Example, Fields
from xgblora.errors import UserError

log = logging.getLogger("xgblora")


class PairTask(CustomTask):
    """Query/positive rows (hard negatives in `negative`, `negative_1`, `negative_2`, ... or a list `negatives`)
    from --train_file/--eval_file; --columns maps other names, e.g. query=question,positive=passage for BoolQ. A
    custom task (the same files, sampling and hold-out) whose rows are pairs."""

    name, dir_name = "pairs", "pairs"
    metric, generation, instruction = "recall@1", False, False

    def __init__(self, cfg: DataOptions):
        if not cfg.train_file and not (cfg.evaluation_only and cfg.eval_file):
            raise UserError(f"--objective {cfg.objective} needs --train_file with query/positive rows (and optional "
                            f"negative or negatives); --columns maps your names, e.g. query=question,positive=passage")
        self.train_file, self.eval_file = cfg.train_file, cfg.eval_file
        self.columns = parse_columns(cfg.columns)

    def build(self, r: Fields) -> list[Example]:
        return [Example(r.text("query"), (r.text("positive"), *hard_negatives(r)), (0,), source=r.source)]


NUMBERED_NEGATIVE = re.compile(r"negative_(\d+)")


def hard_negatives(r: Fields) -> list[str]:
    """A row's hard negatives: the list `negatives`, the column `negative`, and the columns `negative_1`,
    `negative_2`, ... in their order (sentence-transformers' triplet and n-tuple formats)."""
    numbered = sorted((int(m.group(1)), key) for key in r.row if (m := NUMBERED_NEGATIVE.fullmatch(key)))
    return [*(r.texts("negatives") if r.has("negatives") else []),
            *([r.text("negative")] if r.has("negative") else []),
            *(r.text(key) for _, key in numbered)]


def tokenize(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of each text (the tokenizer's special tokens; cut to max_length on the right, as
    sentence-transformers does)."""
    return tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]


def pad_right(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded input_ids and attention_mask of token rows."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def held_apart(train: Sequence[Example], held: Sequence[Example], split: str) -> list[Example]:
    """The held-out pairs whose positive is not a training positive: a document trained on as some query's positive
    would make its retrieval a training score. Says how many were dropped."""
    seen = {ex.candidates[0] for ex in train}
    kept = [ex for ex in held if ex.candidates[0] not in seen]
    if len(kept) < len(held):
        log.info("%s: %d of %d pairs dropped, their positive document is a training positive", split,
                 len(held) - len(kept), len(held))
    return kept


def text_key(text: str) -> int:
    """A 63-bit id of a text: documents with equal keys are the same document."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class PairSeq:
    """One tokenised pair: the query's ids, and each document's (the positive first) with its text key."""

    query: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    keys: tuple[int, ...]


@dataclass(frozen=True)
class Prefixes:
    """Instruction prefixes of queries and documents."""

    query: str = ""
    doc: str = ""


NO_PREFIXES = Prefixes()


def gritlm_instruction(instruction: str) -> str:
    """GritLM's embedding prompt (ContextualAI/gritlm, README and gritlm/training/data.py): the instruction as a user
    turn, then the embed marker; the marker alone without an instruction."""
    return f"<|user|>\n{instruction}\n<|embed|>\n" if instruction else "<|embed|>\n"


def embedding_prefixes(instruction_format: str, query_instruction: str, doc_instruction: str) -> Prefixes:
    """The prefixes of a run's queries and documents: its instructions as they are (plain) or in GritLM's format."""
    if instruction_format == "gritlm":
        return Prefixes(gritlm_instruction(query_instruction), gritlm_instruction(doc_instruction))
    return Prefixes(query_instruction, doc_instruction)


def prefix_length(tokenizer: PreTrainedTokenizerBase, prefix: str) -> int:
    """How many leading tokens of a prefixed text the prefix takes: the prefix tokenised alone, with the tokenizer's
    special tokens but a trailing one ([SEP], EOS) left out. GritLM (gritlm.py `encode`: the instruction's
    tokens) and sentence-transformers (Transformer._get_prompt_length) count alike, so pooling without them matches
    both; 0 for no prefix."""
    if not prefix:
        return 0
    ids = tokenizer(prefix)["input_ids"]
    return len(ids) - 1 if ids and ids[-1] in tokenizer.all_special_ids else len(ids)


def pair_seqs(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
              prefixes: Prefixes = NO_PREFIXES) -> list[PairSeq]:
    """Tokenise every pair once (each distinct document once)."""
    queries = tokenize(tokenizer, [prefixes.query + ex.prompt for ex in examples], max_length)
    docs = list(dict.fromkeys(d for ex in examples for d in ex.candidates))
    doc_ids = dict(zip(docs, tokenize(tokenizer, [prefixes.doc + d for d in docs], max_length), strict=True))
    return [PairSeq(tuple(q), tuple(tuple(doc_ids[d]) for d in ex.candidates), tuple(text_key(d) for d in ex.candidates))
            for q, ex in zip(queries, examples, strict=True)]


def collate_pairs(seqs: Sequence[PairSeq], pad_id: int) -> PairBatch:
    """Right-padded queries and documents (each example's positive, then its negatives) of a batch."""
    query_ids, query_mask = pad_right([s.query for s in seqs], pad_id)
    doc_ids, doc_mask = pad_right([d for s in seqs for d in s.docs], pad_id)
    group = [i for i, s in enumerate(seqs) for _ in s.docs]
    starts = torch.tensor([0, *(len(s.docs) for s in seqs)]).cumsum(0)[:-1]
    return PairBatch(query_ids=query_ids, query_mask=query_mask, doc_ids=doc_ids, doc_mask=doc_mask,
                     doc_group=torch.tensor(group), positive=starts,
                     doc_key=torch.tensor([k for s in seqs for k in s.keys], dtype=torch.long))
