"""Tokenise once, expand (example, candidate) pairs, and collate them into left-padded, length-grouped batches."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from xgblora.data.tasks import Example
from xgblora.errors import UserError

ICL_SEPARATOR = "\n\n"  # MeZO's train_sep between demonstrations


@dataclass(frozen=True)
class TokenSeq:
    """One tokenised sequence whose last `n_target` tokens are scored (a candidate, or a training target)."""

    ids: tuple[int, ...]
    n_target: int
    example: int  # index of the example it came from
    candidate: int  # index of the candidate (0 for generation / instruction targets)


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
        if len(f_ids) > max_length:
            truncated += 1
            f_ids = f_ids[-max_length:]
            n_target = min(n_target, max_length - 1)
        out.append(TokenSeq(tuple(f_ids), n_target, i, j))
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


def collate(seqs: Sequence[TokenSeq], pad_id: int, side: str = "left") -> dict[str, torch.Tensor]:
    """Pad a batch: input_ids, attention_mask, position_ids, and target_mask aligned with input_ids[:, -k:].

    With left padding (the default) every sequence ends at the last column, so the scored tokens of all rows sit
    in the last `k = max n_target` columns and the model computes logits for the last k + 1 positions only
    (logits_to_keep). Right padding scores over the whole width (k = width - 1); it exists for cross-checks.
    """
    width = max(len(s.ids) for s in seqs)
    k = max(s.n_target for s in seqs) if side == "left" else width - 1
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    target_mask = torch.zeros((len(seqs), k), dtype=torch.bool)
    for row, s in enumerate(seqs):
        start = width - len(s.ids) if side == "left" else 0
        ids[row, start:start + len(s.ids)] = torch.tensor(s.ids)
        mask[row, start:start + len(s.ids)] = 1
        end = k - (width - start - len(s.ids))  # target_mask column of the row's last token
        target_mask[row, end - s.n_target:end] = True
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "target_mask": target_mask}


PACKED_KEYS = ("input_ids", "position_ids", "target_index", "target_weight")


def collate_packed(seqs: Sequence[TokenSeq]) -> dict[str, torch.Tensor]:
    """Padding-free batch: the sequences end to end in one row, positions restarting at 0 (no attention_mask).

    target_index [1, K]: the positions whose logits predict the K scored tokens (each one's previous position);
    target_weight [1, n, K]: 1 / n_target where target k belongs to sequence i, so target_weight @ logprobs is
    each sequence's mean target log-probability. transformers keeps the sequences apart from the restarting
    position_ids (flash-attention varlen kernels; a block-diagonal mask elsewhere) for the model families that
    pass position_ids to their mask: `packing_supported` checks a model.
    """
    ids: list[int] = []
    positions: list[int] = []
    index: list[int] = []
    owner: list[int] = []
    for i, s in enumerate(seqs):
        end = len(ids) + len(s.ids)
        ids.extend(s.ids)
        positions.extend(range(len(s.ids)))
        index.extend(range(end - s.n_target - 1, end - 1))
        owner.extend([i] * s.n_target)
    weight = torch.zeros(1, len(seqs), len(index))
    weight[0, owner, torch.arange(len(index))] = torch.tensor([1.0 / seqs[i].n_target for i in owner])
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions]),
            "target_index": torch.tensor([index]), "target_weight": weight}


def split_packed(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """The packed batch of sequences start..stop-1 of a packed batch (its tokens are one contiguous slice)."""
    starts = [*(batch["position_ids"][0] == 0).nonzero().flatten().tolist(), batch["input_ids"].shape[1]]
    first, last = starts[start], starts[stop]
    index = batch["target_index"]
    keep = (index[0] >= first) & (index[0] < last)
    return {"input_ids": batch["input_ids"][:, first:last], "position_ids": batch["position_ids"][:, first:last],
            "target_index": index[:, keep] - first, "target_weight": batch["target_weight"][:, start:stop][:, :, keep],
            **{k: v for k, v in batch.items() if k not in PACKED_KEYS}}


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def target_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-probability of each target token, shape [B, k] (zero where target_mask is False)."""
    target_mask = batch["target_mask"]
    k = target_mask.shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], logits_to_keep=k + 1).logits[:, :-1]
    return _token_logprobs(logits, batch["input_ids"][:, -k:]) * target_mask


def packed_mean_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each packed sequence's mean target log-probability, shape [rows * n] (rows > 1: copies, e.g. dual MeZO)."""
    index = batch["target_index"]
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], logits_to_keep=index,
                   use_cache=False).logits  # transformers looks for packed sequences only without a cache
    logprobs = _token_logprobs(logits, batch["input_ids"].gather(1, index + 1))
    return (batch["target_weight"] @ logprobs.unsqueeze(-1)).reshape(-1)


@torch.no_grad()
def packing_supported(model: torch.nn.Module) -> bool:
    """Whether the model keeps packed sequences apart: a sequence packed after two different ones scores the same.

    Rows [A, C] and [B, C] with restarting position ids: without a leak across the boundary C's logits are the
    same in both rows (masked keys add exact zeros; measured: 0.0 on Llama shapes in fp32 and bf16), with one they
    differ by a third of the largest logit (OPT); 1e-3 of it is the bar. C must also score about as it does alone
    (10%: bf16 rounding of a 16-layer model reaches 1.5%), so that the positions restart. A model that cannot run
    the packed forward at all does not support packing.
    """
    weight = model.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, weight.shape[0], (n,), generator=gen).tolist() for n in (6, 6, 9))
    positions = [*range(len(a)), *range(len(c))]
    was_training = model.training
    model.eval()
    try:
        packed = model(input_ids=torch.tensor([a + c, b + c], device=weight.device), use_cache=False,
                       position_ids=torch.tensor([positions, positions], device=weight.device)).logits[:, len(a):]
        alone = model(input_ids=torch.tensor([c], device=weight.device)).logits[0].float()
    except (RuntimeError, TypeError, ValueError):
        return False
    finally:
        model.train(was_training)
    packed, scale = packed.float(), alone.abs().max().item()
    leak = (packed[0] - packed[1]).abs().max().item()
    return leak <= 1e-3 * scale and (packed[0] - alone).abs().max().item() <= 0.1 * scale


def iter_batches(seqs: Sequence[TokenSeq], batch_size: int, pad_id: int, device: torch.device,
                 side: str = "left") -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """Yield (indices, batch on device) over seqs in length-sorted batches."""
    for idx in length_grouped_batches(seqs, batch_size):
        batch = collate([seqs[i] for i in idx], pad_id, side)
        yield idx, {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def gold_continuation(ex: Example) -> str:
    """The text a training example is trained on: its gold candidate, or its first answer (spaced after the prompt)."""
    if ex.candidates:
        return ex.candidates[ex.gold[0]]
    answer = ex.answers[0] if ex.answers else ""
    return answer if not ex.prompt or ex.prompt[-1].isspace() else " " + answer


def training_seqs(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
                  all_candidates: bool = False) -> list[TokenSeq]:
    """Tokenise the training set once: the gold continuation of each example, or every candidate (classification)."""
    if all_candidates:
        return encode_pairs(tokenizer, examples, max_length)
    gold_only = [Example(ex.prompt, (gold_continuation(ex),), (0,)) for ex in examples]
    return encode_pairs(tokenizer, gold_only, max_length)


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int,
                  group_by_length: bool = True) -> list[list[int]]:
    """One epoch's batches of example indices: a seeded shuffle, then (HF-style) length grouping within mega-batches.

    The order depends only on (seed, epoch), so a resumed run sees the same batches as an uninterrupted one.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    if group_by_length:
        mega = batch_size * 50
        order = [i for k in range(0, len(order), mega)
                 for i in sorted(order[k:k + mega], key=lambda i: -lengths[i])]
    batches = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    if group_by_length and len(batches) > 1:  # length-sorted mega-batches would put the longest batches first
        perm = torch.randperm(len(batches), generator=gen).tolist()
        batches = [batches[p] for p in perm]
    return batches


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences (indices into a TokenSeq list) whose first `length` tokens are the same and none of them scored."""

    rows: tuple[int, ...]
    length: int


def shared_prefix_groups(seqs: Sequence[TokenSeq]) -> tuple[list[PrefixGroup], list[int]]:
    """Group each example's sequences by their common prefix (cut before the first scored token of any of them).

    Returns the groups worth scoring against one cached prefix (two or more sequences, a prefix of at least one
    token) and the indices of the sequences that are not in any group (to score whole).
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
        if len(rows) > 1 and length > 0:
            groups.append(PrefixGroup(tuple(rows), length))
        else:
            alone.extend(rows)
    return groups, alone


def collate_prefix_suffix(seqs: Sequence[TokenSeq], groups: Sequence[PrefixGroup],
                          pad_id: int) -> dict[str, torch.Tensor]:
    """A batch of shared prefixes (left-padded) and of the sequences' suffixes after them (right-padded).

    prefix_*: one row per group, ending in the last column (input_ids, attention_mask, position_ids).
    suffix_*: one row per sequence, in group order: the tokens after its group's prefix, positions continuing the
    prefix's, an attention_mask over prefix + suffix columns; `owner` is the row's group (prefix row) and
    `target_mask` marks the scored tokens among the suffix columns. Suffix column j is predicted by the logits
    of suffix column j - 1, and column 0 by the prefix's last logits.
    """
    prefixes = [TokenSeq(seqs[g.rows[0]].ids[:g.length], 0, k, 0) for k, g in enumerate(groups)]
    prefix = collate(prefixes, pad_id)
    del prefix["target_mask"]
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
    return {f"prefix_{k}": v for k, v in prefix.items()} | {
        "suffix_input_ids": ids, "suffix_position_ids": lengths[:, None] + torch.arange(width),
        "suffix_attention_mask": torch.cat([prefix["attention_mask"][owner], mask], dim=1),
        "owner": owner, "target_mask": target_mask}


def contiguous_head_input(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle | None:
    """Hand the LM head a contiguous input (a forward pre-hook on the output embeddings); returns its handle.

    With logits_to_keep, transformers passes the head a strided slice of the hidden states, and F.linear then
    runs a batched matmul against the weight broadcast to every row instead of one GEMM: on the CPU (torch 2.13,
    an opt-125m head over 8 x 17 positions) 2.2x slower in fp32 and 12x in bf16, for the same numbers.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))
