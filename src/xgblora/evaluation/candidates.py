"""Evaluation as MeZO does it: candidate scoring by log-probability (optionally SFC-calibrated), greedy generation + F1/EM."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from xgblora.data.collation import (
    PrefixGroup,
    TokenSeq,
    collate_prefix_suffix,
    common_prefix_length,
    demonstration_text,
    encode_pairs,
    iter_batches,
    shared_prefix_groups,
)
from xgblora.data.tasks import Example, Task
from xgblora.evaluation.answers import f1_score, normalize_answer
from xgblora.models.sampler import greedy_continuations
from xgblora.models.scoring import contiguous_head_input, eval_mode, target_logprobs, token_logprobs


def caches_prefixes(model: PreTrainedModel) -> bool:
    """Whether candidates can be scored against a cached prompt: a decoder-only LM with full attention in every layer."""
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (model.can_generate() and not config.is_encoder_decoder and layer_types == {"full_attention"}
            and not getattr(config, "sliding_window", None))


@dataclass(frozen=True)
class SharedPrefix:
    """The KV cache of the tokens every sequence of an evaluation starts with (the demonstrations of in-context
    evaluation), computed once and copied into each batch that continues it."""

    length: int
    cache: Cache

    @classmethod
    @torch.inference_mode()
    def encode(cls, model: PreTrainedModel, ids: Sequence[int]) -> SharedPrefix:
        """Run the prefix once (one row, no padding) and keep its cache."""
        device = next(model.parameters()).device
        out = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=True, logits_to_keep=1)
        return cls(len(ids), out.past_key_values)

    def expanded(self, rows: int) -> Cache:
        """A copy of the cache with `rows` identical rows (a batch appends its own tokens to it)."""
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(rows)
        return cache


def prefix_cached_logprobs(model: PreTrainedModel, batch: dict[str, torch.Tensor],
                           shared: SharedPrefix | None = None) -> torch.Tensor:
    """Log-probability of each scored suffix token of a `collate_prefix_suffix` batch, [rows, suffix width].

    The shared prefixes run once with use_cache=True (after `shared`'s cached tokens when given: the batch was
    collated with start=shared.length); their KV cache is expanded to one row per sequence and the suffixes run
    against it. When every suffix is one token the prefixes' last logits score them all, and the second pass is
    skipped.
    """
    owner, suffix_ids = batch["owner"], batch["suffix_input_ids"]
    width = suffix_ids.shape[1]
    past = shared.expanded(batch["prefix_input_ids"].shape[0]) if shared is not None else None
    out = model(input_ids=batch["prefix_input_ids"], attention_mask=batch["prefix_attention_mask"],
                position_ids=batch["prefix_position_ids"], past_key_values=past,
                use_cache=width > 1 or past is not None, logits_to_keep=1)
    logits = out.logits[owner]
    if width > 1:
        cache = out.past_key_values
        cache.batch_select_indices(owner)
        tail = model(input_ids=suffix_ids[:, :-1], attention_mask=batch["suffix_attention_mask"][:, :-1],
                     position_ids=batch["suffix_position_ids"][:, :-1], past_key_values=cache, use_cache=True).logits
        logits = torch.cat([logits, tail], dim=1)
    return token_logprobs(logits, suffix_ids) * batch["target_mask"]


def _group_batches(seqs: list[TokenSeq], groups: list[PrefixGroup], batch_size: int, pad_id: int,
                   device: torch.device, cached: int = 0):
    """Yield (sequence indices, prefix/suffix batch on device) over the groups, longest prefixes first; the first
    `cached` tokens of every prefix are in a shared cache."""
    order = sorted(groups, key=lambda g: -g.length)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = collate_prefix_suffix(seqs, chunk, pad_id, start=cached)
        yield [r for g in chunk for r in g.rows], {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _split_groups(groups: list[PrefixGroup], shared: SharedPrefix | None) -> tuple[list[PrefixGroup], list[int]]:
    """The groups whose prefix goes past the shared cached tokens, and the rows of those that do not (scored whole)."""
    if shared is None:
        return groups, []
    longer = [g for g in groups if g.length > shared.length]
    return longer, [r for g in groups if g.length <= shared.length for r in g.rows]


@torch.inference_mode()
def _sum_logprobs(model: PreTrainedModel, seqs, batch_size: int, pad_id: int, prefix_cache: bool = True,
                  shared: SharedPrefix | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed target log-probability and target length of every sequence, in input order.

    Identical sequences (e.g. SFC calibration prompts shared by all examples) are scored once. With
    prefix_cache (and a model that caches prefixes), the candidates of each example are scored
    against its prompt's KV cache (`prefix_cached_logprobs`), the prompt itself run after `shared`'s cached
    tokens (the demonstrations) when given; the rest go through whole-sequence batches.
    """
    device = next(model.parameters()).device
    first: dict[tuple[tuple[int, ...], int], int] = {}
    unique: list[TokenSeq] = []
    where = []
    for s in seqs:
        where.append(first.setdefault((s.ids, s.n_target), len(unique)))
        if where[-1] == len(unique):
            unique.append(s)
    sums = torch.zeros(len(unique), dtype=torch.float64)
    counts = torch.zeros(len(unique), dtype=torch.float64)
    groups, alone = [], list(range(len(unique)))
    if prefix_cache and caches_prefixes(model):
        groups, alone = shared_prefix_groups(unique, min_rows=1 if shared is not None else 2)
        groups, past_shared = _split_groups(groups, shared)
        alone = alone + past_shared
    for idx, batch in iter_batches([unique[i] for i in alone], batch_size, pad_id, device):
        idx = [alone[i] for i in idx]
        sums[idx] = target_logprobs(model, batch).sum(-1).double().cpu()
        counts[idx] = batch.target_mask.sum(-1).double().cpu()
    cached = shared.length if shared is not None else 0
    for idx, batch in _group_batches(unique, groups, batch_size, pad_id, device, cached):
        sums[idx] = prefix_cached_logprobs(model, batch, shared).sum(-1).double().cpu()
        counts[idx] = batch["target_mask"].sum(-1).double().cpu()
    return sums[where], counts[where]


# Below this many shared tokens, copying their cache into every batch costs about what it saves
MIN_SHARED_PREFIX = 16


def _demonstrations_cache(model: PreTrainedModel, seqs: list[TokenSeq]) -> SharedPrefix | None:
    """The shared cache of the tokens every sequence starts with, where the model caches prefixes and there are
    MIN_SHARED_PREFIX or more (truncation from the left can leave none)."""
    length = common_prefix_length(seqs)
    if length < MIN_SHARED_PREFIX or not caches_prefixes(model):
        return None
    return SharedPrefix.encode(model, seqs[0].ids[:length])


def candidate_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *,
                     demos: Sequence[Example] = (), sfc: bool = False, icl_sfc: bool = False, batch_size: int = 8,
                     max_length: int = 2048, prefix_cache: bool = True) -> list[list[float]]:
    """Score every candidate of every example, batched across examples, longest first.

    The score is the mean log-probability of the candidate's tokens after the prompt (MeZO), or with SFC the
    summed log-probability minus that under the example's calibration prompt (surface-form competition).
    With prefix_cache each prompt runs once and its candidates are scored against its KV
    cache, and the demonstrations, which every sequence starts with, run once for the whole call (their cache is
    copied into every batch, SFC calibration's under icl_sfc included); otherwise, and for models without a cache,
    every (example, candidate) pair runs whole. batch_size counts prompts in the first case and pairs in the second.
    """
    prefix = demonstration_text(demos)
    seqs = encode_pairs(tokenizer, examples, max_length, prefix=prefix)
    calib = encode_pairs(tokenizer, examples, max_length, prefix=prefix if icl_sfc else "",
                         prompts=[ex.sfc_prompt for ex in examples]) if sfc or icl_sfc else None
    head_hook = contiguous_head_input(model)
    pad_id = tokenizer.pad_token_id
    try:
        with eval_mode(model):
            shared = _demonstrations_cache(model, seqs + (calib if icl_sfc else [])) if prefix and prefix_cache \
                else None
            sums, counts = _sum_logprobs(model, seqs, batch_size, pad_id, prefix_cache, shared)
            if calib is not None:
                calib_sums, _ = _sum_logprobs(model, calib, batch_size, pad_id, prefix_cache,
                                              shared if icl_sfc else None)
    finally:
        if head_hook is not None:
            head_hook.remove()
    values = sums - calib_sums if calib is not None else sums / counts
    scores: list[list[float]] = [[0.0] * len(ex.candidates) for ex in examples]
    for seq, value in zip(seqs, values.tolist(), strict=True):
        scores[seq.example][seq.candidate] = value
    return scores


@torch.inference_mode()
def generate_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *,
                     demos: Sequence[Example] = (), batch_size: int = 8, max_length: int = 2048,
                     max_new_tokens: int = 50) -> list[str]:
    """MeZO's generation protocol (SQuAD, DROP): greedy answers stopped at a newline or EOS, first line kept."""
    prefix = demonstration_text(demos)
    prompt_ids = tokenizer([prefix + ex.prompt for ex in examples], add_special_tokens=True)["input_ids"]
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1:]
    stop = [t for t in [tokenizer.eos_token_id, *newline] if t is not None]
    texts = greedy_continuations(model, tokenizer, prompt_ids, stop, batch_size=batch_size, max_length=max_length,
                     max_new_tokens=max_new_tokens)
    return [text.strip().split("\n")[0].strip() for text in texts]


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, examples: Sequence[Example], *,
             demos: Sequence[Example] = (), sfc: bool = False, icl_sfc: bool = False, batch_size: int = 8,
             max_length: int = 2048, max_new_tokens: int = 50) -> dict[str, float]:
    """Task metric on examples: {"accuracy": ...} for candidate tasks, {"f1": ..., "em": ...} for generation."""
    if not examples:
        return {}
    if task.generation:
        preds = generate_answers(model, tokenizer, examples, demos=demos, batch_size=batch_size,
                                 max_length=max_length, max_new_tokens=max_new_tokens)
        f1 = [max(f1_score(p, a) for a in ex.answers) for p, ex in zip(preds, examples, strict=True)]
        em = [max(float(normalize_answer(p) == normalize_answer(a)) for a in ex.answers)
              for p, ex in zip(preds, examples, strict=True)]
        return {"f1": sum(f1) / len(f1), "em": sum(em) / len(em)}
    scores = candidate_scores(model, tokenizer, examples, demos=demos, sfc=sfc, icl_sfc=icl_sfc,
                              batch_size=batch_size, max_length=max_length)
    correct = [max(range(len(s)), key=s.__getitem__) in ex.gold for s, ex in zip(scores, examples, strict=True)]
    return {"accuracy": sum(correct) / len(correct)}
