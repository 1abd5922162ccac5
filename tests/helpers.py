"""Helpers shared by several test modules (test modules do not import each other)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import signal
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from xgblora import cli, train
from xgblora.adapters.lora import LoRALinear, attach, is_adapter_param
from xgblora.config import Config
from xgblora.data import formats
from xgblora.data.batches import TokenBatch
from xgblora.data.pairs import collate_pairs, pair_seqs
from xgblora.data.splits import load_rows
from xgblora.data.tasks import CustomTask, Example
from xgblora.embeddings.contrastive import Contrastive
from xgblora.logs import read_metrics
from xgblora.models import pretrained
from xgblora.optim.zo import MeZO
from xgblora.recipes.sft import run
from xgblora.train.objective import (
    grit_training_set,
    per_example_loss,
    sequence_training_set,
)

# runs of tiny-opt on SST-2: a config, its metrics and adapter, interrupts


def make_cfg(data_dir: Path, out: Path, **overrides) -> Config:
    """A small, fast SST-2 run on tiny-opt; overrides win."""
    values = dict(model_name="tiny-opt", task_name="SST2", data_dir=str(data_dir), num_train=64, num_eval=16,
                  trainer="regular", method="lora", learning_rate=3e-3, max_steps=12, logging_steps=2,
                  per_device_train_batch_size=8, per_device_eval_batch_size=16, max_length=64,
                  output_dir=str(out), result_file=str(out / "mezo_result.json"), device="cpu", seed=3)
    values.update(overrides)
    return Config(**values)


def records(out: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock field."""
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in read_metrics(out / "metrics.jsonl")]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "adapter_model.safetensors"))


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def interrupt_at(at_step: int, how: str = "sigint") -> train.Hooks:
    """Loop hooks that interrupt a run right after optimizer step `at_step`.

    "sigint" sends a real SIGINT to this process (the loop's own handler turns it into a checkpoint and a stop);
    "crash" raises, as a kill would stop the run without any checkpoint beyond the periodic ones.
    """
    def interrupt(state: train.LoopState) -> None:
        if state.step != at_step:
            return
        if how == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            raise RuntimeError("simulated crash")

    return train.Hooks(on_step_end=[interrupt])


# processes started by a test: ports, environment, flags, their outputs


def flags(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in (f"--{k}", str(v))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


ADAPTER = "final/adapter_model.safetensors"


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def assert_close_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **tol, msg=lambda m, key=key: f"{key}: {m}")


# zeroth-order references: MeZO's documented seeds and z, a loss, adapted tiny-opt


def step_seeds(seed: int, n: int) -> list[int]:
    """The documented step-seed sequence of MeZO(seed=seed)."""
    rng = torch.Generator().manual_seed(seed)
    return [int(torch.randint(2**62, (1,), generator=rng)) for _ in range(n)]


def reference_z(params: list[torch.Tensor], step_seed: int) -> list[torch.Tensor]:
    """The documented z: a CPU generator seeded with the step seed; torch.normal in param order and dtype."""
    gen = torch.Generator().manual_seed(step_seed)
    return [torch.normal(0.0, 1.0, p.shape, generator=gen, dtype=p.dtype) for p in params]


def no_decay(name: str) -> bool:
    """OPT's biases and layer norms (the names this test file meets) take no weight decay."""
    return name.endswith(".bias") or "layer_norm" in name


def ce_loss_fn(model: nn.Module):
    """Per-example mean token cross-entropy of a causal LM: the loss_fn contract of MeZO.step."""

    def loss_fn(batch: TokenBatch) -> torch.Tensor:
        ids = batch.input_ids
        logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(dim=1)

    return loss_fn


def random_batch(vocab: int, seed: int, rows: int = 4, length: int = 12) -> TokenBatch:
    """Random token ids (no padding), every token after the first scored."""
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    return TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids),
                      position_ids=torch.arange(length).expand(rows, length),
                      target_mask=torch.ones(rows, length - 1, dtype=torch.bool))


def loss_at(model: nn.Module, names: list[str], values: list[torch.Tensor],
            batch: TokenBatch) -> float:
    """Mean loss of `model` with the named parameters set to `values` (the model is changed)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in zip(names, values, strict=True):
            params[name].copy_(value)
        return float(ce_loss_fn(model)(batch).mean())


def adapted(tiny: nn.Module, r: int, active_every: int = 1) -> tuple[nn.Module, dict[str, LoRALinear]]:
    """tiny-opt with LoRA on q/v, B random (both factors matter); every active_every-th module trains."""
    model = copy.deepcopy(tiny)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(r)
        modules = attach(model, r=r).modules
        for i, m in enumerate(modules.values()):
            with torch.no_grad():
                m.lora_B.normal_(0.0, 0.05)
            m.active = i % active_every == 0
            m.lora_A.requires_grad_(m.active)
            m.lora_B.requires_grad_(m.active)
    return model, modules


# contrastive batches: pairs and GRIT rows of mixed length, losses and gradients


TOPICS = ["the movie was a love story", "a film about the war", "the best story of the year", "a boring time",
          "funny and good", "the terrible acting", "a great new film", "what a fun movie", "the dull plot",
          "a story of love and time", "the worst film"]


def pair_batch(tokenizer, n: int = 10, negatives: int = 1):
    """n pairs of queries, positives and hard negatives of different lengths (so mini-batches cut padding)."""
    examples = [Example(f"what about {t}{' really' * (i % 4)}?",
                        (f"{t}. It was {'great' if i % 2 else 'bad'}.",
                         *(f"{TOPICS[(i + 3 + k) % len(TOPICS)]}, they said{' so' * k}." for k in range(negatives))),
                        (0,)) for i, t in enumerate(TOPICS[:n])]
    return collate_pairs(pair_seqs(tokenizer, examples, 32), tokenizer.pad_token_id)


def loss_and_grads(model, batch, objective: Contrastive, params) -> tuple[float, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    loss = per_example_loss(model, batch, objective).mean()
    loss.backward()
    return float(loss.detach()), grads(params)


def grads(params) -> list[torch.Tensor]:
    """Each parameter's gradient (zeros where none reached it: the unused pooler)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def assert_same(plain, cached):
    assert cached[0] == pytest.approx(plain[0], rel=1e-6)
    # to 1e-5 of the largest gradient: float rounding differs between the two orders of summation (and some
    # gradients are zero up to rounding: a key bias cannot change a softmax)
    scale = max(float(g.abs().max()) for g in plain[1])
    for g_plain, g_cached in zip(plain[1], cached[1], strict=True):
        torch.testing.assert_close(g_cached, g_plain, rtol=1e-5, atol=1e-5 * scale)


def grit_batch(tokenizer, tmp_path):
    """8 pairs of different lengths beside 8 instruction rows."""
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Is {t} good?", "completion": " Yes."}) + "\n" for t in TOPICS),
                   encoding="utf-8")
    examples = load_rows(CustomTask(Config(task_name="custom", train_file=str(sft)).data), "train", None)
    seqs = formats.instruction_seqs(tokenizer, examples, 32, False, formats.stop_token_ids(tokenizer))
    generative = sequence_training_set(seqs, tokenizer.pad_token_id, token_mean=True)
    pairs = pair_seqs(tokenizer, [Example(f"what about {t}{' now' * (i % 3)}?", (f"{t}, they said{' so' * i}.",),
                                          (0,)) for i, t in enumerate(TOPICS)], 32)
    return grit_training_set(pairs, generative, tokenizer.pad_token_id).batch(range(8))


def grit_loss_and_grads(model, batch, objective: Contrastive) -> tuple[float, list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss = per_example_loss(model, batch, objective).mean()
    loss.backward()
    return float(loss.detach()), grads(params)


def dual_batch_losses(objectives: list[Contrastive]) -> list[tuple[float, float]]:
    """MeZO's L+ and L- of one step on the same LoRA start and seed, for each objective."""
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    batch = pair_batch(tokenizer, n=8)
    report = attach(model, None, r=4, alpha=8)
    with torch.no_grad():
        for m in report.modules.values():
            m.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    params = [(n, p) for n, p in model.named_parameters() if is_adapter_param(n)]
    start = {n: p.detach().clone() for n, p in params}
    found = []
    for objective in objectives:
        with torch.no_grad():
            for n, p in params:
                p.copy_(start[n])
        mezo = MeZO(params, 1e-2, 1e-2, dual_modules=report.modules, seed=7)
        found.append(mezo.step(lambda b, objective=objective: per_example_loss(model.eval(), b, objective), batch))
    return found


def run_losses(tmp_path, monkeypatch, tag: str, **options) -> list[float]:
    """The logged losses of 4 LoRA steps of a dropout-free tiny BERT on pairs of different lengths."""
    kind, shape = pretrained.RANDOM_MODELS["tiny-bert"]
    monkeypatch.setitem(pretrained.RANDOM_MODELS, "tiny-bert",
                        (kind, {**shape, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"what about {t}{' now' * (i % 4)}?",
                                        "positive": f"{t}, they said{' so' * i}."}) + "\n"
                            for i, t in enumerate(TOPICS)), encoding="utf-8")
    out = tmp_path / tag
    run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(data), num_train=10, method="lora",
               learning_rate=1e-2, max_steps=4, logging_steps=1, per_device_train_batch_size=8, max_length=24,
               output_dir=str(out), device="cpu", no_eval=True, save_strategy="no", **options))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under folder (hidden ones too) with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def killed_at_step(monkeypatch, call: int):
    """Within the block, the call-th optimizer step of any Trainer raises KeyboardInterrupt (a kill before the
    step, after the checkpoints of the steps before it)."""
    from xgblora.train import loop

    real_step, calls = loop.Trainer.train_step, []

    def dying(self):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(loop.Trainer, "train_step", dying)
    try:
        yield
    finally:
        monkeypatch.setattr(loop.Trainer, "train_step", real_step)


# tiny causal LMs saved as model folders (the GGUF export's input)


def tiny_causal_folder(tmp: Path, model_type: str, **shape) -> Path:
    """A tiny model of the type; Qwen2's with Qwen2's own pre-tokenizer split (before byte-level BPE)."""
    tokenizer = pretrained.tiny_tokenizer()
    if model_type == "qwen2":
        from tokenizers import Regex, pre_tokenizers
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # non-zero biases, so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    folder = tmp / f"tiny-{model_type}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# the shared-prompt forward of dpo and grpo

def shared_prompt_batch(vocab: int) -> tuple[torch.Tensor, ...]:
    """Two left-padded prompts, each with two right-padded completions (GRPO's group, DPO's pair)."""
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, vocab, (2, 7), generator=g)
    prompt_mask = torch.ones(2, 7, dtype=torch.long)
    prompt_mask[1, :3] = 0
    completion = torch.randint(3, vocab, (4, 6), generator=g)
    completion_mask = torch.ones(4, 6, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    return prompt_ids, prompt_mask, torch.tensor([0, 0, 1, 1]), completion, completion_mask


def addition_pairs(path: Path, n: int = 8) -> str:
    """Preference rows on two-digit sums, the right sum chosen over a wrong one (seeded); the file's path."""
    rng, rows = random.Random(0), []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a + b + rng.randint(1, 9)}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def preference_run(command: str, out: Path, rows: str, *flags: str) -> tuple[dict, list[dict]]:
    """`xgblora COMMAND` (dpo, kto, reward) on tiny-llama, the rows both trained on and held out, batch 4, a log line
    a step: its results.json and the logged steps."""
    code = cli.main([command, "--model_name", "tiny-llama", "--train_file", rows, "--eval_file", rows,
                     "--output_dir", str(out), "--per_device_train_batch_size", "4", "--logging_steps", "1", *flags])
    assert code == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "results.json").read_text()), [m for m in logged if "loss" in m]

