"""Tokenise once, expand (example, candidate) pairs, and collate them into left-padded, length-grouped batches."""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from xgblora.data.batches import PackedBatch, TokenBatch
from xgblora.data.tasks import Example
from xgblora.errors import UserError

ICL_SEPARATOR = "\n\n"  # MeZO's train_sep between demonstrations


@dataclass(frozen=True)
class TokenSeq:
    """One tokenised sequence whose last `n_target` tokens hold the scored ones (a candidate, or a training target).

    `loss_mask` marks which of those last n_target tokens are scored (None: all of them): a multi-turn conversation
    scores its assistant turns, not the user turns between them. Its first entry is True.
    """

    ids: tuple[int, ...]
    n_target: int
    example: int  # index of the example it came from
    candidate: int  # index of the candidate (0 for generation / instruction targets)
    loss_mask: tuple[bool, ...] | None = None

    def target_offsets(self) -> list[int]:
        """Positions in `ids` of the scored tokens."""
        start = len(self.ids) - self.n_target
        if self.loss_mask is None:
            return list(range(start, len(self.ids)))
        return [start + k for k, scored in enumerate(self.loss_mask) if scored]

    def truncated(self, max_length: int) -> TokenSeq:
        """The sequence cut from the left to max_length tokens, keeping at least one token before the targets."""
        cut = len(self.ids) - max_length
        if cut <= 0:
            return self
        n_target = min(self.n_target, max_length - 1)
        mask = self.loss_mask[self.n_target - n_target:] if self.loss_mask is not None else None
        while mask is not None and mask and not mask[0]:  # the window starts at a scored token
            mask, n_target = mask[1:], n_target - 1
        return dataclasses.replace(self, ids=self.ids[cut:], n_target=n_target, loss_mask=mask or None)


def demonstration_text(demos: Sequence[Example]) -> str:
    """In-context demonstrations as MeZO writes them: each demo verbalised with its gold answer, joined by blank lines."""
    parts = []
    for demo in demos:
        answer = demo.candidates[demo.gold[0]] if demo.candidates else (demo.answers[0] if demo.answers else "")
        parts.append((demo.prompt + answer).strip())
    return ICL_SEPARATOR.join(parts) + ICL_SEPARATOR if parts else ""


def _split_target(prompt_ids: list[int], full_ids: list[int]) -> int:
    """Number of trailing tokens of full_ids that belong to the continuation (at least one)."""
    common = 0
    for a, b in zip(prompt_ids, full_ids, strict=False):
        if a != b:
            break
        common += 1
    return max(1, len(full_ids) - common)


def encode_pairs(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                 prefix: str = "", prompts: Sequence[str] | None = None) -> list[TokenSeq]:
    """Tokenise every (example, candidate) pair in two batched tokenizer calls; prompts default to each example's prompt.

    Inputs longer than max_length are cut from the left, so the candidate tokens are always kept; one warning
    gives the count.
    """
    texts_prompt, texts_full, owners = [], [], []
    for i, ex in enumerate(examples):
        prompt = prefix + (prompts[i] if prompts is not None else ex.prompt)
        for j, cand in enumerate(ex.candidates):
            texts_prompt.append(prompt)
            texts_full.append(prompt + cand)
            owners.append((i, j))
    if not owners:
        return []
    prompt_ids = tokenizer(texts_prompt, add_special_tokens=True)["input_ids"]
    full_ids = tokenizer(texts_full, add_special_tokens=True)["input_ids"]
    out, truncated = [], 0
    for (i, j), p_ids, f_ids in zip(owners, prompt_ids, full_ids, strict=True):
        n_target = _split_target(p_ids, f_ids)
        if n_target >= len(f_ids):  # an empty prompt: the first candidate token needs a token to be predicted from
            start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            if start is None:
                raise UserError(f"example {i}: its prompt is empty and the tokenizer has no BOS/EOS token to "
                                f"score candidate {j} after")
            f_ids = [start, *f_ids]
        seq = TokenSeq(tuple(f_ids), n_target, i, j)
        truncated += len(seq.ids) > max_length
        out.append(seq.truncated(max_length))
    if truncated:
        warnings.warn(f"{truncated} of {len(out)} inputs were longer than max_length={max_length} tokens and were "
                      f"truncated from the left (the answer is kept)", stacklevel=2)
    return out


def length_grouped_batches(seqs: Sequence[TokenSeq], batch_size: int, shuffle_seed: int | None = None) -> list[list[int]]:
    """Indices of seqs in batches of similar length (sorted, longest first); batch order shuffled when a seed is given."""
    order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k].ids))
    batches = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(batches)
    return batches


def pad_multiple(device: torch.device) -> int:
    """The multiple padded training batches are widened to: 64 on CUDA, where every new batch shape costs a kernel
    plan (cuDNN attention builds one per shape, about a second), so that an epoch meets at most max_length / 64
    widths; 1 elsewhere (no per-shape cost on the CPU, and padding is work)."""
    return 64 if device.type == "cuda" else 1


def collate(seqs: Sequence[TokenSeq], pad_id: int, pad_to_multiple_of: int = 1) -> TokenBatch:
    """Left-pad a batch: every sequence ends at the last column, so the scored tokens of all rows sit in the last
    `k = max n_target` columns and the model computes logits for the last k + 1 positions only (logits_to_keep).
    The width is the longest sequence's, rounded up to a multiple of pad_to_multiple_of."""
    width = -(-max(len(s.ids) for s in seqs) // pad_to_multiple_of) * pad_to_multiple_of
    k = max(s.n_target for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    target_mask = torch.zeros((len(seqs), k), dtype=torch.bool)
    for row, s in enumerate(seqs):
        start = width - len(s.ids)
        ids[row, start:] = torch.tensor(s.ids)
        mask[row, start:] = 1
        target_mask[row, k - s.n_target:] = True if s.loss_mask is None else torch.tensor(s.loss_mask)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return TokenBatch(input_ids=ids, attention_mask=mask, position_ids=position_ids, target_mask=target_mask)


def collate_packed(seqs: Sequence[TokenSeq], token_mean: bool = False) -> PackedBatch:
    """Padding-free batch: the sequences end to end in one row, positions restarting at 0 (no attention_mask).

    transformers keeps the sequences apart from the restarting position_ids (flash-attention varlen kernels; a
    block-diagonal mask elsewhere) for the model families that pass position_ids to their mask:
    `scoring.packing_supported` checks a model. token_mean: each scored token weighs n / (the batch's scored
    tokens), so the mean over the n sequences is the batch's mean over tokens; else 1 / (its sequence's).
    """
    ids: list[int] = []
    positions: list[int] = []
    index: list[int] = []
    owner: list[int] = []
    for i, s in enumerate(seqs):
        index.extend(len(ids) + k - 1 for k in s.target_offsets())
        owner.extend([i] * (len(index) - len(owner)))
        ids.extend(s.ids)
        positions.extend(range(len(s.ids)))
    counts = torch.bincount(torch.tensor(owner), minlength=len(seqs)).double()
    per_token = torch.full((len(seqs),), len(seqs) / len(index)) if token_mean else (1.0 / counts).float()
    weight = torch.zeros(1, len(seqs), len(index))
    weight[0, owner, torch.arange(len(index))] = per_token[owner]
    return PackedBatch(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                       target_index=torch.tensor([index]), target_weight=weight)


def iter_batches(seqs: Sequence[TokenSeq], batch_size: int, pad_id: int,
                 device: torch.device) -> Iterator[tuple[list[int], TokenBatch]]:
    """Yield (indices, batch on device) over seqs in length-sorted batches."""
    for idx in length_grouped_batches(seqs, batch_size):
        yield idx, collate([seqs[i] for i in idx], pad_id).to(device)


def gold_continuation(ex: Example) -> str:
    """The text a training example is trained on: its gold candidate, or its first answer, after a space unless
    the prompt ends in one or the answer starts with one (so a sampled completion follows its prompt exactly)."""
    if ex.candidates:
        return ex.candidates[ex.gold[0]]
    answer = ex.answers[0] if ex.answers else ""
    return answer if not ex.prompt or ex.prompt[-1].isspace() or answer[:1].isspace() else " " + answer


def training_seqs(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                  all_candidates: bool = False) -> list[TokenSeq]:
    """Tokenise the training set once: the gold continuation of each example, or every candidate (classification)."""
    if all_candidates:
        return encode_pairs(tokenizer, examples, max_length)
    gold_only = [Example(ex.prompt, (gold_continuation(ex),), (0,)) for ex in examples]
    return encode_pairs(tokenizer, gold_only, max_length)


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences (indices into a TokenSeq list) whose first `length` tokens are the same and none of them scored."""

    rows: tuple[int, ...]
    length: int


def shared_prefix_groups(seqs: Sequence[TokenSeq], min_rows: int = 2) -> tuple[list[PrefixGroup], list[int]]:
    """Group each example's sequences by their common prefix (cut before the first scored token of any of them).

    Returns the groups worth scoring against one cached prefix (min_rows or more sequences, a prefix of at least
    one token) and the indices of the sequences that are not in any group (to score whole). min_rows=1 makes a
    group of a lone sequence too (worth it when its prompt continues a cache shared by every example).
    """
    by_example: dict[int, list[int]] = {}
    for row, s in enumerate(seqs):
        by_example.setdefault(s.example, []).append(row)
    groups, alone = [], []
    for rows in by_example.values():
        length = min(len(seqs[r].ids) - seqs[r].n_target for r in rows)
        first = seqs[rows[0]].ids
        for r in rows[1:]:
            other = seqs[r].ids
            length = next((k for k in range(length) if other[k] != first[k]), length)
        if len(rows) >= min_rows and length > 0:
            groups.append(PrefixGroup(tuple(rows), length))
        else:
            alone.extend(rows)
    return groups, alone


def common_prefix_length(seqs: Sequence[TokenSeq]) -> int:
    """Length of the token prefix that every sequence starts with (the demonstrations of in-context evaluation),
    cut so that every sequence keeps at least one unscored token after it (whose logits score its first target)."""
    if not seqs:
        return 0
    first = seqs[0].ids
    length = min(len(s.ids) - s.n_target for s in seqs) - 1
    for s in seqs[1:]:
        length = next((k for k in range(length) if s.ids[k] != first[k]), length)
    return max(length, 0)


def collate_prefix_suffix(seqs: Sequence[TokenSeq], groups: Sequence[PrefixGroup], pad_id: int,
                          start: int = 0) -> dict[str, torch.Tensor]:
    """A batch of shared prefixes (left-padded) and of the sequences' suffixes after them (right-padded).

    prefix_*: one row per group, ending in the last column (input_ids, attention_mask, position_ids).
    suffix_*: one row per sequence, in group order: the tokens after its group's prefix, positions continuing the
    prefix's, an attention_mask over prefix + suffix columns; `owner` is the row's group (prefix row) and
    `target_mask` marks the scored tokens among the suffix columns. Suffix column j is predicted by the logits
    of suffix column j - 1, and column 0 by the prefix's last logits.
    start: the first `start` tokens of every prefix are already in a KV cache (the demonstrations, shared by all
    groups, each longer than start): prefix_input_ids hold the tokens after them, the positions continue from start,
    and both attention masks begin with `start` columns of ones for the cached tokens.
    """
    prefixes = [TokenSeq(seqs[g.rows[0]].ids[start:g.length], 0, k, 0) for k, g in enumerate(groups)]
    prefix = collate(prefixes, pad_id)
    prefix.attention_mask = torch.cat([torch.ones(len(groups), start, dtype=torch.long), prefix.attention_mask], 1)
    rows = [(k, seqs[r], g.length) for k, g in enumerate(groups) for r in g.rows]
    width = max(len(s.ids) - n for _, s, n in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    target_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, (_, s, n) in enumerate(rows):
        tail = len(s.ids) - n
        ids[row, :tail] = torch.tensor(s.ids[n:])
        mask[row, :tail] = 1
        target_mask[row, tail - s.n_target:tail] = True
    owner = torch.tensor([k for k, _, _ in rows])
    lengths = torch.tensor([n for _, _, n in rows])
    return {"prefix_input_ids": prefix.input_ids, "prefix_attention_mask": prefix.attention_mask,
            "prefix_position_ids": prefix.position_ids + start,
            "suffix_input_ids": ids, "suffix_position_ids": lengths[:, None] + torch.arange(width),
            "suffix_attention_mask": torch.cat([prefix.attention_mask[owner], mask], dim=1),
            "owner": owner, "target_mask": target_mask}
