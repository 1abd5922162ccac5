"""The benchmark's workloads: synthetic training and evaluation data, the models, and one step function per workload."""

from __future__ import annotations

import argparse
import random

import torch

from xgblora.adapters import lora
from xgblora.data.batches import TokenBatch
from xgblora.data.collation import TokenSeq, collate
from xgblora.data.splits import load_rows
from xgblora.data.tasks import RTE, Example, get_task
from xgblora.models import pretrained
from xgblora.optim.fo import AdamWStepper
from xgblora.optim.zo import MeZO, ZOStepper
from xgblora.train.objective import TrainingLoss, per_example_loss

_WORDS = ("the", "movie", "was", "great", "and", "story", "fun", "but", "ending", "felt", "long", "so", "I",
          "would", "not", "see", "it", "again", "this", "film", "is", "a", "good", "one", "with", "some", "bad",
          "parts", "very", "dull", "plot", "actors")


def synthetic_seqs(n: int, seq_len: int, n_target: int, vocab: int, seed: int = 0) -> list[TokenSeq]:
    """n random token sequences of seq_len tokens (ids 3.. vocab-1, clear of pad/bos/eos), last n_target scored."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, seq_len), generator=gen).tolist()
    return [TokenSeq(tuple(row), n_target, i, 0) for i, row in enumerate(ids)]


def synthetic_examples(n: int, premise_words: int = 50, seed: int = 0) -> list[Example]:
    """n RTE-shaped examples: a random-word premise and hypothesis in RTE's template, candidates Yes / No."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(_WORDS) for _ in range(k)).capitalize() + "."  # noqa: E731
    return [RTE().examples({"premise": words(premise_words), "hypothesis": words(8),
                            "label": rng.choice(["entailment", "not_entailment"])}, ("synthetic", i))[0]
            for i in range(n)]


def eval_examples(args: argparse.Namespace) -> tuple[list[Example], str]:
    """The evaluation workload: the first eval_examples dev examples of eval_task, or synthetic RTE-shaped ones."""
    if args.data_dir is None:
        return synthetic_examples(args.eval_examples), "synthetic RTE-shaped (50-word premise)"
    task = get_task(args.eval_task)
    return load_rows(task, "eval", args.data_dir)[:args.eval_examples], f"{task.name} dev rows from {args.data_dir}"


class Bench:
    """The models, data and step functions of one benchmark configuration."""

    def __init__(self, args: argparse.Namespace, with_lora: bool = True, with_plain: bool = True) -> None:
        self.args = args
        self.device = pretrained.choose_device(args.device)
        self.plain, self.tokenizer = (pretrained.load(args.model_name, dtype=args.dtype, device=args.device,
                                                                      build_on_device=True)
                                      if with_plain else (None, None))
        self.lora_model, self.lora_report = None, None
        if with_lora:
            self.lora_model, tok = pretrained.load(args.model_name, dtype=args.dtype, device=args.device,
                                                   build_on_device=True)
            self.tokenizer = self.tokenizer or tok
            self.lora_report = lora.attach(self.lora_model, ["q_proj", "v_proj"], r=8, alpha=16.0)
        model = self.plain if self.plain is not None else self.lora_model
        self.vocab = int(model.config.vocab_size)
        self.n_target = args.target_len or max(1, args.seq_len // 8)
        self.pool = synthetic_seqs(max(64, 4 * args.batch_size), args.seq_len, self.n_target, self.vocab)
        self._cursor = 0
        self._steppers: dict[str, AdamWStepper | ZOStepper] = {}

    def next_batch(self) -> TokenBatch:
        """The next training batch from the pool, collated exactly as `xgblora train` does, on the device."""
        b = self.args.batch_size
        rows = [(self._cursor + k) % len(self.pool) for k in range(b)]
        self._cursor = (self._cursor + b) % len(self.pool)
        return collate([self.pool[r] for r in rows], self.tokenizer.pad_token_id).to(self.device)

    # --- workloads: each runs one unit of work (timing is done outside)

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        """One plain forward (per-example loss, no gradients) of the model without adapters."""
        self.plain.eval()
        with torch.no_grad():
            return per_example_loss(self.plain, batch)

    def lora_forward(self, batch: TokenBatch) -> torch.Tensor:
        """One forward (no gradients) of the model with LoRA adapters attached."""
        self.lora_model.eval()
        with torch.no_grad():
            return per_example_loss(self.lora_model, batch)

    def zo_step(self, batch: TokenBatch) -> torch.Tensor:
        """One MeZO step on the LoRA adapters with the dual-batch forward: the stepper `xgblora train --trainer zo`
        runs."""
        if "zo" not in self._steppers:
            mezo = MeZO(self._adapters(), lr=1e-5, eps=1e-3, dual_modules=self.lora_report.modules)
            self._steppers["zo"] = ZOStepper(mezo, TrainingLoss(self.lora_model), device=self.device)
        self.lora_model.eval()
        return self._steppers["zo"].step(lambda: batch, lr=1e-5)

    def zo_full_step(self, batch: TokenBatch) -> torch.Tensor:
        """One full-model MeZO step (two forwards, three in-place sweeps over all weights)."""
        if "zo_full" not in self._steppers:
            lora.prepare_full_ft(self.plain)
            mezo = MeZO(list(self.plain.named_parameters()), lr=1e-7, eps=1e-3)
            self._steppers["zo_full"] = ZOStepper(mezo, TrainingLoss(self.plain), device=self.device)
        self.plain.eval()
        return self._steppers["zo_full"].step(lambda: batch, lr=1e-7)

    def adamw_step(self, batch: TokenBatch) -> torch.Tensor:
        """One AdamW LoRA step (forward, backward, clip to 1.0, fused AdamW): the stepper of `xgblora train`."""
        if "adamw" not in self._steppers:
            self._steppers["adamw"] = AdamWStepper(self._adapters(), TrainingLoss(self.lora_model),
                                                   max_grad_norm=1.0, micro_batch=self.args.batch_size)
        self.lora_model.train()
        return self._steppers["adamw"].step(lambda: batch, lr=1e-4)

    def _adapters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return lora.adapter_params(self.lora_model)
