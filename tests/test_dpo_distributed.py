"""`xgblora dpo` data-parallel on the CPU with gloo: 2 ranks of 2 pairs train like 1 process of 4 (each rank's
pairs, their reference log-probabilities, and the gradient all-reduced), and a 2-rank run resumes exactly."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_close_tensors, flags, free_port, worker_env
from safetensors.torch import load_file

WORKER = "import sys\nfrom xgblora import cli\nsys.exit(cli.main(['dpo', *sys.argv[1:]]))\n"
ADAPTER = "final/adapter_model.safetensors"


@pytest.fixture
def pairs(tmp_path) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a + b + rng.randint(1, 9)}"})
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def options(pairs: Path, out: str, **overrides) -> dict:
    values = dict(model_name="tiny-llama", train_file=str(pairs), method="lora", learning_rate=1e-3,
                  lr_scheduler_type="constant", max_steps=3, logging_steps=1, save_strategy="no", device="cpu",
                  seed=5, output_dir=str(pairs.parent / out))
    return {**values, **overrides}


def torchrun(pairs: Path, values: dict, nproc: int) -> dict:
    """`torchrun --nproc_per_node nproc` on the CPU (gloo); the main process's results.json."""
    script = pairs.parent / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", str(script), *flags(values)]
    done = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((Path(values["output_dir"]) / "results.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_two_ranks_of_two_pairs_train_like_one_process_of_four_and_resume_exactly(pairs):
    torchrun(pairs, options(pairs, "one", per_device_train_batch_size=4), nproc=1)
    two = torchrun(pairs, options(pairs, "two", per_device_train_batch_size=2, save_strategy="steps", save_steps=1),
                   nproc=2)
    assert two["world_size"] == 2
    one_adapter, two_adapter = load_file(pairs.parent / "one" / ADAPTER), load_file(pairs.parent / "two" / ADAPTER)
    assert any(t.abs().sum() > 0 for k, t in one_adapter.items() if "lora_B" in k)  # trained
    # the two sums of the gradient round differently in float32; after 3 AdamW steps of lr = 1e-3 (lora_B up to
    # 3e-3) that was 1.6e-7 at most
    assert_close_tensors(one_adapter, two_adapter, atol=1e-5, rtol=0)

    resumed = torchrun(pairs, options(pairs, "resumed", per_device_train_batch_size=2,
                                      resume_from_checkpoint=str(pairs.parent / "two/checkpoints/step-1")), nproc=2)
    assert resumed["resumes"] == 1
    assert_close_tensors(two_adapter, load_file(pairs.parent / "resumed" / ADAPTER), atol=0, rtol=0)
