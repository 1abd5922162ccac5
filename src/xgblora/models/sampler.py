"""Sampling completions from a causal LM, N per prompt, fast. The contract:

- Each prompt runs through the model once; its KV cache is repeated for its N samples. (Hugging Face `generate`
  with `num_return_sequences=N` repeats the prompt first and runs it N times.)
- A sample that emits a stop token stops drawing; once a quarter of a batch's rows have stopped, their cache rows
  are dropped, so finished samples soon cost no compute. (Dropping rows copies the whole cache; doing it at
  every stop would copy it at nearly every step of a large batch.)
- Prompts are grouped, longest first, into batches whose KV cache holds at most `max_batch_tokens` tokens
  (rows x (longest prompt + max_new_tokens)): memory is bounded by a token budget, not a batch size, and nothing
  needs emptying between batches.
- Greedy when temperature is 0; otherwise temperature and top-p through transformers' own logits warpers.
- Deterministic: the batch plan depends only on the prompt lengths and the parameters, and each batch draws from
  its own generator seeded from (seed, batch number). A caller that skips finished batches after an interruption
  gets exactly what an uninterrupted run would have written.
- Or, given a seed per prompt, each prompt's samples draw from uniforms of their own (one per sample and step, from
  a CPU generator seeded by the prompt's seed, turned into tokens by the inverse of the warped distribution): a
  prompt's completions then do not depend on the batch it lands in, the prompts beside it, or the process that
  samples it (to float rounding of the logits), so processes can share out the prompts of one sampling.

Each `Sample` keeps the model's log-probability of its tokens (before temperature and top-p), so a caller can
check or rank samples without a second forward.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from xgblora.models.scoring import eval_mode

TokenCallback = Callable[[torch.Tensor, torch.Tensor], None]  # (sample rows, their new tokens) after each step
RowsCallback = Callable[[torch.Tensor], None]  # the prompt of every row of the next forward


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: N per prompt, up to max_new_tokens each, greedy at temperature 0."""

    num_samples: int = 1
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_batch_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.max_new_tokens < 1 or self.max_batch_tokens < 1:
            raise ValueError("num_samples, max_new_tokens and max_batch_tokens must be positive")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")


@dataclass(frozen=True)
class Sample:
    """One completion: its tokens (the stop token left out), why it ended, the model's summed log-probability
    of its tokens and of the stop token that ended it, and that stop token (None when it ran to max_new_tokens)."""

    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens reached)
    logprob: float
    stop_id: int | None = None


def plan_batches(prompt_lengths: Sequence[int], params: SamplingParams) -> list[list[int]]:
    """Prompt indices grouped into batches, longest prompts first, each within the token budget (at least one
    prompt per batch)."""
    order = sorted(range(len(prompt_lengths)), key=lambda i: (-prompt_lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            width = prompt_lengths[batches[-1][0]] + params.max_new_tokens  # the batch's first prompt is its longest
            if (len(batches[-1]) + 1) * params.num_samples * width <= params.max_batch_tokens:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


def stream_seed(*parts: object) -> int:
    """A 63-bit seed named by its parts (a run's seed and what draws from it): streams of other names are unrelated."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def batch_generator(seed: int, batch_number: int, device: torch.device) -> torch.Generator:
    """The random generator of one batch: its draws do not depend on which other batches run."""
    return torch.Generator(device).manual_seed(stream_seed(seed, batch_number))


def prompt_uniforms(seeds: Sequence[int], num_samples: int, steps: int) -> torch.Tensor:
    """[prompts x num_samples, steps] uniforms in [0, 1), each prompt's rows from a CPU generator of its own seed."""
    return torch.cat([torch.rand(num_samples, steps, generator=torch.Generator().manual_seed(s)) for s in seeds])


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's draw from its distribution given its uniform u: the first token whose cumulative probability
    reaches u x the total. Tokens of probability 0 (cut by top-p, or underflowed) are never taken: a cumulative sum
    on the GPU need not stay flat across them."""
    cdf = probs.cumsum(-1)
    positive = probs > 0
    total = cdf.where(positive, 0).amax(-1, keepdim=True)  # reached by a token that can be drawn, so one always is
    return (positive & (cdf >= uniforms[:, None] * total)).int().argmax(-1)  # argmax: the first such token


class Sampler:
    """Draws samples for batches of tokenised prompts from one model (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, pad_id: int, stop_ids: Sequence[int], params: SamplingParams):
        self.model, self.pad_id, self.params = model, pad_id, params
        self.device = next(model.parameters()).device
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=self.device)
        self.warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature > 0 else []
        if params.temperature > 0 and params.top_p < 1:
            self.warpers.append(TopPLogitsWarper(params.top_p))

    def run(self, prompts: Sequence[Sequence[int]], skip: Container[int] = (), seeds: Sequence[int] | None = None,
            on_rows: RowsCallback | None = None) -> Iterator[tuple[list[int], list[list[Sample]]]]:
        """Yield (prompt indices, their samples) batch by batch, in plan order; a batch whose prompts are all in
        skip is not run (its batch number, and so every other batch's draws, stay the same). With seeds (one per
        prompt), each prompt draws from its own (see the module docstring). on_rows sees, before every forward,
        the index in prompts of each row it runs (for a model whose rows differ by more than their tokens)."""
        for number, batch in enumerate(plan_batches([len(p) for p in prompts], self.params)):
            if all(i in skip for i in batch):
                continue
            draws = batch_generator(self.params.seed, number, self.device) if seeds is None else \
                [seeds[i] for i in batch]
            # a row of the batch -> its prompt in prompts (made only for a caller that follows its rows)
            batch_rows = None if on_rows is None else \
                functools.partial(_rows_in, on_rows, torch.tensor(batch, device=self.device))
            yield batch, self.sample_batch([prompts[i] for i in batch], draws, on_rows=batch_rows)

    @torch.inference_mode()
    def sample_batch(self, prompts: Sequence[Sequence[int]], draws: torch.Generator | Sequence[int],
                     on_tokens: TokenCallback | None = None, on_rows: RowsCallback | None = None
                     ) -> list[list[Sample]]:
        """num_samples samples of each prompt, drawn from the batch's generator or from each prompt's seed; on_tokens
        sees every step's new tokens (for streaming); on_rows, before every forward, the prompt of each row."""
        uniforms = None if isinstance(draws, torch.Generator) else \
            prompt_uniforms(draws, self.params.num_samples, self.params.max_new_tokens).to(self.device)
        with eval_mode(self.model):
            if on_rows is not None:
                on_rows(torch.arange(len(prompts), device=self.device))
            logits, cache, mask = self._prefill(prompts)
            drawn = _Drawn(len(prompts) * self.params.num_samples, self.params.max_new_tokens, self.pad_id)
            sample = torch.arange(drawn.rows, device=self.device)  # the sample each row of the batch draws
            running = torch.ones(drawn.rows, dtype=torch.bool, device=self.device)
            for step in range(self.params.max_new_tokens):
                token, logprob = self._pick(logits, draws if uniforms is None else uniforms[sample, step])
                stops = torch.isin(token, self.stop_ids) & running
                drawn.record(step, sample[running].cpu(), token[running].cpu(), logprob[running].cpu(),
                             stops[running].cpu())
                running &= ~stops
                if on_tokens is not None:
                    on_tokens(sample[running], token[running])
                if step + 1 == self.params.max_new_tokens or not running.any():
                    break
                if 4 * int((~running).sum()) >= len(running):  # a quarter stopped: drop them (module docstring)
                    keep = running.nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    sample, token, mask, running = sample[keep], token[keep], mask[keep], running[keep]
                mask = torch.cat([mask, mask.new_ones(len(sample), 1)], dim=1)
                if on_rows is not None:
                    on_rows(sample // self.params.num_samples)
                logits = self._decode(token, mask, cache)
        return drawn.samples(self.params.num_samples)

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, object, torch.Tensor]:
        """Run the left-padded prompts once; repeat the last logits, cache and mask for each of their samples."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                         use_cache=True, logits_to_keep=1)
        logits, cache = out.logits[:, -1].float(), out.cache
        n = self.params.num_samples
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask = logits.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        return logits, cache, mask

    def _decode(self, token: torch.Tensor, mask: torch.Tensor, cache: object) -> torch.Tensor:
        """The next-token logits after one new token per row; positions count only real (unpadded) tokens."""
        position = mask.sum(1, keepdim=True) - 1
        out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=position, cache=cache,
                         use_cache=True)
        return out.logits[:, -1].float()

    def _pick(self, logits: torch.Tensor, draws: torch.Generator | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of every row (argmax, or a draw from the warped distribution: from the batch's generator,
        or by each row's own uniform) and its log-probability."""
        logprobs = torch.log_softmax(logits, dim=-1)
        if not self.warpers:
            token = logits.argmax(-1)
        else:
            scores = logits
            for warp in self.warpers:
                scores = warp(None, scores)
            probs = torch.softmax(scores, dim=-1)
            token = torch.multinomial(probs, 1, generator=draws).squeeze(1) if isinstance(draws, torch.Generator) \
                else inverse_cdf(probs, draws)
        return token, logprobs.gather(1, token[:, None]).squeeze(1)


def _rows_in(on_rows: RowsCallback, prompts: torch.Tensor, rows: torch.Tensor) -> None:
    """on_rows told the prompts (indices into the whole run's) of a batch's rows (indices into the batch)."""
    on_rows(prompts[rows])


class _Drawn:
    """What the samples of one batch have drawn so far: tokens, lengths, summed log-probabilities, stop flags."""

    def __init__(self, rows: int, max_new_tokens: int, pad_id: int):
        self.rows = rows
        self.tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.logprobs = torch.zeros(rows, dtype=torch.float64)
        self.stopped = torch.zeros(rows, dtype=torch.bool)
        self.stop_ids = torch.full((rows,), -1, dtype=torch.long)

    def record(self, step: int, sample: torch.Tensor, token: torch.Tensor, logprob: torch.Tensor,
               stops: torch.Tensor) -> None:
        """One step's draws of the running samples; a stop token ends its sample without being kept."""
        going = sample[~stops]
        self.tokens[going, step] = token[~stops]
        self.lengths[going] += 1
        self.logprobs[sample] += logprob.double()
        self.stopped[sample[stops]] = True
        self.stop_ids[sample[stops]] = token[stops]

    def samples(self, per_prompt: int) -> list[list[Sample]]:
        """The Samples, grouped per prompt."""
        flat = [Sample(tuple(self.tokens[r, :self.lengths[r]].tolist()), "stop" if self.stopped[r] else "length",
                       float(self.logprobs[r]), int(self.stop_ids[r]) if self.stopped[r] else None)
                for r in range(self.rows)]
        return [flat[i:i + per_prompt] for i in range(0, self.rows, per_prompt)]


def greedy_continuations(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[Sequence[int]],
             stop_ids: Sequence[int], *, batch_size: int = 8, max_length: int = 2048,
             max_new_tokens: int = 50) -> list[str]:
    """Greedy continuations of tokenised prompts (the sampler at temperature 0), each stopped at a stop token.

    Prompts longer than max_length - max_new_tokens tokens are cut from the left, so the question and the answer
    cue at their end are kept (as MeZO does); one warning gives the count. A batch holds as much KV cache as
    batch_size prompts of max_length tokens: more prompts when they are short.
    """
    budget = max(1, max_length - max_new_tokens)
    truncated = sum(len(ids) > budget for ids in prompt_ids)
    if truncated:
        warnings.warn(f"{truncated} of {len(prompt_ids)} prompts were longer than max_length - max_new_tokens = "
                      f"{budget} tokens and were truncated from the left (the question and answer cue are kept)",
                      stacklevel=2)
    params = SamplingParams(max_new_tokens=max_new_tokens, max_batch_tokens=batch_size * (budget + max_new_tokens))
    sampler = Sampler(model, tokenizer.pad_token_id, stop_ids, params)
    texts = [""] * len(prompt_ids)
    for batch, samples in sampler.run([list(ids[-budget:]) for ids in prompt_ids]):
        for i, [sample] in zip(batch, samples, strict=True):
            texts[i] = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    return texts
