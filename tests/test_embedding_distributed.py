"""The contrastive loss across processes (gloo, 2 CPU ranks): every rank's documents are negatives of every query,
so 2 ranks x b train exactly like 1 rank x 2b, under AdamW (gradients through the gather) and MeZO's dual batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ADAPTER, assert_close_tensors, flags, free_port, losses, worker_env
from safetensors.torch import load_file

from xgblora.config import Config
from xgblora.models import pretrained
from xgblora.recipes import sft

# One rank: tiny-bert without dropout, so that 1 x 2b and 2 x b compute the same function.
WORKER = '''
import sys
from xgblora import cli
from xgblora.models import pretrained
kind, shape = pretrained.RANDOM_MODELS["tiny-bert"]
pretrained.RANDOM_MODELS["tiny-bert"] = (kind, {**shape, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
sys.exit(cli.main(["train", *sys.argv[1:]]))
'''

WORDS = ["film", "story", "war", "love", "time", "plot", "acting", "fun", "year", "music", "city", "night"]


def options(tmp_path: Path, out: Path, **overrides) -> dict:
    """21 pairs (batches of 8 leave a tail of 5: shards of 3 and 2 rows), a hard negative each."""
    data = tmp_path / "pairs.jsonl"
    if not data.exists():
        rows = [{"query": f"what about the {WORDS[i % 12]} of {WORDS[(i * 5) % 12]}?",
                 "positive": f"the {WORDS[i % 12]} and {WORDS[(i * 5) % 12]} were good",
                 "negative": f"the {WORDS[(i + 1) % 12]} was bad"} for i in range(23)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    values = dict(model_name="tiny-bert", objective="contrastive", train_file=str(data), num_train=21,
                  method="lora", trainer="regular", learning_rate=1e-2, max_steps=6, logging_steps=1,
                  per_device_train_batch_size=4, max_length=24, output_dir=str(out), device="cpu", seed=3,
                  no_eval=True, save_strategy="no")
    values.update(overrides)
    return values


def run_one(monkeypatch: pytest.MonkeyPatch, values: dict) -> dict:
    kind, shape = pretrained.RANDOM_MODELS["tiny-bert"]
    monkeypatch.setitem(pretrained.RANDOM_MODELS, "tiny-bert",
                        (kind, {**shape, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))
    return sft.run(Config(**values))


def torchrun(tmp_path: Path, values: dict) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", str(script), *flags(values)]
    done = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((Path(values["output_dir"]) / "results.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("trainer", ["regular", "zo"], ids=["adamw-gather-with-gradients", "mezo-dual-batch"])
def test_two_ranks_train_like_one_rank_with_the_combined_batch(tmp_path, monkeypatch, trainer):
    extra = {} if trainer == "regular" else dict(trainer="zo", learning_rate=1e-3, zo_eps=1e-2)
    run_one(monkeypatch, options(tmp_path, tmp_path / "one", per_device_train_batch_size=8, **extra))
    two = torchrun(tmp_path, options(tmp_path, tmp_path / "two", **extra))
    assert two["world_size"] == 2
    one_losses, two_losses = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert two_losses == pytest.approx(one_losses, rel=1e-5) and one_losses[0] != one_losses[-1]
    assert_close_tensors(load_file(tmp_path / "one" / ADAPTER), load_file(tmp_path / "two" / ADAPTER),
                         rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_with_gradient_caching_train_like_one_rank_with_the_combined_batch(tmp_path, monkeypatch):
    """Each rank embeds its 4 pairs 2 at a time; the gathered documents of both ranks are every query's negatives."""
    run_one(monkeypatch, options(tmp_path, tmp_path / "one", per_device_train_batch_size=8))
    two = torchrun(tmp_path, options(tmp_path, tmp_path / "two", mini_batch_size=2))
    assert two["world_size"] == 2
    one_losses, two_losses = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert two_losses == pytest.approx(one_losses, rel=1e-5) and one_losses[0] != one_losses[-1]
    assert_close_tensors(load_file(tmp_path / "one" / ADAPTER), load_file(tmp_path / "two" / ADAPTER),
                         rtol=1e-4, atol=1e-6)
