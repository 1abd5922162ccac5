"""One evaluator per kind of run, chosen once when the run is set up and called by the loop and at the end.

Every evaluator is called as `evaluator(model, examples, demos=())` and returns the metrics and one prediction
record per generated example (empty where nothing is generated). The model is an argument, not a field: the loop
evaluates the model it trains, and the same evaluator serves a model before and after training.

    Candidates    MeZO's tasks on a causal LM: each candidate's log-likelihood (in-context demos, SFC), or F1/EM
                  of generated answers
    Labels        a classifier or masked-LM head: the arg-max label
    Instructions  instruction/chat data: loss, perplexity, generations and their EM/F1/GSM8K accuracy
    Retrieval     an embedding model: recall@1/5/10 and MRR of held-out queries against their split's corpus
    Reranking     a cross-encoder: MAP, MRR@10 and nDCG@10 of each held-out query's passages, reranked
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from transformers import PreTrainedTokenizerBase

from xgblora.data.labels import LabelScoring
from xgblora.data.pairs import Prefixes
from xgblora.data.tasks import Example, Task
from xgblora.evaluation import candidates, labels, reranking, retrieval
from xgblora.evaluation.instructions import evaluate_instructions

Metrics = dict[str, Any]
Predictions = list[dict[str, Any]]


class Evaluator(Protocol):
    def __call__(self, model: nn.Module, examples: Sequence[Example], demos: Sequence[Example] = ()
                 ) -> tuple[Metrics, Predictions]: ...


@dataclass(frozen=True)
class EvalSizes:
    """How much evaluation reads and writes at once: examples per forward, tokens per example, tokens generated."""

    batch_size: int
    max_length: int
    max_new_tokens: int


@dataclass(frozen=True)
class Candidates:
    tokenizer: PreTrainedTokenizerBase
    task: Task
    sizes: EvalSizes
    sfc: bool = False
    icl_sfc: bool = False

    def __call__(self, model: nn.Module, examples: Sequence[Example], demos: Sequence[Example] = ()
                 ) -> tuple[Metrics, Predictions]:
        return candidates.evaluate(model, self.tokenizer, self.task, examples, demos=demos, sfc=self.sfc,
                                   icl_sfc=self.icl_sfc, batch_size=self.sizes.batch_size,
                                   max_length=self.sizes.max_length, max_new_tokens=self.sizes.max_new_tokens), []


@dataclass(frozen=True)
class Labels:
    tokenizer: PreTrainedTokenizerBase
    scoring: LabelScoring
    sizes: EvalSizes

    def __call__(self, model: nn.Module, examples: Sequence[Example], demos: Sequence[Example] = ()
                 ) -> tuple[Metrics, Predictions]:
        """A label head reads one input: in-context demonstrations do not apply."""
        return labels.evaluate(model, self.tokenizer, examples, self.scoring, batch_size=self.sizes.batch_size,
                               max_length=self.sizes.max_length), []


@dataclass(frozen=True)
class Instructions:
    tokenizer: PreTrainedTokenizerBase
    stop_ids: tuple[int, ...]
    sizes: EvalSizes
    train_on_prompt: bool = False

    def __call__(self, model: nn.Module, examples: Sequence[Example], demos: Sequence[Example] = ()
                 ) -> tuple[Metrics, Predictions]:
        return evaluate_instructions(model, self.tokenizer, examples, stop_ids=self.stop_ids,
                                     batch_size=self.sizes.batch_size, max_length=self.sizes.max_length,
                                     max_new_tokens=self.sizes.max_new_tokens, train_on_prompt=self.train_on_prompt)


@dataclass(frozen=True)
class Retrieval:
    tokenizer: PreTrainedTokenizerBase
    pooling: str
    sizes: EvalSizes
    prefixes: Prefixes
    bidirectional: bool = False
    include_prompt: bool = True

    def __call__(self, model: nn.Module, examples: Sequence[Example], demos: Sequence[Example] = ()
                 ) -> tuple[Metrics, Predictions]:
        return retrieval.evaluate(model, self.tokenizer, examples, pooling=self.pooling,
                                  max_length=self.sizes.max_length, batch_size=self.sizes.batch_size,
                                  bidirectional=self.bidirectional, prefixes=self.prefixes,
                                  include_prompt=self.include_prompt), []


@dataclass(frozen=True)
class Reranking:
    tokenizer: PreTrainedTokenizerBase
    sizes: EvalSizes

    def __call__(self, model: nn.Module, examples: Sequence[Example], demos: Sequence[Example] = ()
                 ) -> tuple[Metrics, Predictions]:
        """A reranker reads one pair at a time: in-context demonstrations do not apply."""
        return reranking.evaluate(model, self.tokenizer, examples, max_length=self.sizes.max_length,
                                  batch_size=self.sizes.batch_size), []
