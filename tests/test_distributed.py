"""Data parallelism on the CPU with gloo and 2 processes: 2 ranks x b train exactly like 1 rank x 2b (AdamW, MeZO),
MeZO sends only its losses, resume works across ranks, and a rank that dies or stalls stops the others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ADAPTER, assert_close_tensors, flags, free_port, losses, worker_env
from safetensors.torch import load_file

from xgblora import distributed
from xgblora.config import Config
from xgblora.models import pretrained
from xgblora.recipes import sft

# One rank of a test run: tiny-opt without dropout (so 1 x 2b and 2 x b see the same function); gradient buckets of
# XGBLORA_TEST_BUCKET_BYTES; rank 1 dies or stalls after step XGBLORA_TEST_FAIL_AT_STEP. These variables are read
# here only, not by xgblora.
WORKER = '''
import os, sys, time
from xgblora import cli
from xgblora import distributed
from xgblora.models import pretrained
from xgblora import train
from xgblora.recipes import sft
distributed.BUCKET_BYTES = int(os.environ.get("XGBLORA_TEST_BUCKET_BYTES", distributed.BUCKET_BYTES))
kind, shape = pretrained.RANDOM_MODELS["tiny-opt"]
pretrained.RANDOM_MODELS["tiny-opt"] = (kind, {**shape, "dropout": 0.0})
at = int(os.environ.get("XGBLORA_TEST_FAIL_AT_STEP", "0"))
if at and os.environ["RANK"] == "1":
    def fail(state):
        if state.step == at:
            if os.environ["XGBLORA_TEST_FAIL_HOW"] == "exit":
                os._exit(17)
            time.sleep(600)
    run = sft.run
    sft.run = lambda cfg: run(cfg, hooks=train.Hooks(on_step_end=[fail]))
sys.exit(cli.main(["train", *sys.argv[1:]]))
'''

TEXTS = ["a fine film", "dull", "the best story of the year", "boring and bad", "funny", "I love it",
         "terrible acting, terrible plot", "great", "not good", "very much fun", "bad", "a good time", "awful",
         "wonderful", "a waste of time", "brilliant", "weak", "touching", "flat", "charming", "tedious", "superb"]


def options(tmp_path: Path, out: Path, **overrides) -> dict:
    """A small custom sentiment task on tiny-opt; 21 training examples, so batches of 8 leave a tail of 5."""
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(TEXTS)),
                        encoding="utf-8")
    values = dict(model_name="tiny-opt", task_name="custom", train_file=str(data), template="{text} It was",
                  label_words="terrible,great", num_train=21, num_eval=1, trainer="regular", method="lora",
                  learning_rate=1e-2, max_steps=6, logging_steps=1, per_device_train_batch_size=4,
                  per_device_eval_batch_size=8, max_length=32, output_dir=str(out),
                  result_file=str(out / "mezo.json"), device="cpu", seed=5, no_eval=True)
    values.update(overrides)
    return values


def run_one(monkeypatch: pytest.MonkeyPatch, values: dict) -> dict:
    """The single-process reference, in this process (tiny-opt without dropout, as in WORKER)."""
    kind, shape = pretrained.RANDOM_MODELS["tiny-opt"]
    monkeypatch.setitem(pretrained.RANDOM_MODELS, "tiny-opt", (kind, {**shape, "dropout": 0.0}))
    return sft.run(Config(**values))


def torchrun(tmp_path: Path, values: dict, nproc: int = 2, **env: str) -> dict:
    """Train with `torchrun --nproc_per_node nproc` on the CPU (gloo); return the main process's results.json."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend",
           "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", str(script), *flags(values)]
    done = subprocess.run(cmd, env=worker_env(**env), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((Path(values["output_dir"]) / "results.json").read_text(encoding="utf-8"))


def test_shards_cover_the_global_batch_once_and_weigh_each_example_equally():
    shards = [distributed.Distributed().shard_of(list(range(5)))]  # one process: the whole batch
    assert shards == [(list(range(5)), 1.0)]

    class Fake:  # the two attributes shard_of reads from an Accelerator
        num_processes = 3

        def __init__(self, rank):
            self.process_index = rank

    for n in (1, 2, 3, 7, 9):
        parts = [distributed.Distributed(Fake(r)).shard_of(list(range(n))) for r in range(3)]
        counted = [i for (idx, scale) in parts if scale > 0 for i in idx]
        assert counted == list(range(n))  # contiguous, in order, each example once
        # each rank's mean loss times its scale, averaged over ranks, weighs every example 1/n
        weights = [scale / len(idx) / 3 for idx, scale in parts if scale > 0]
        assert all(w == pytest.approx(1 / n) for w in weights)


def test_adamw_lora_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path, monkeypatch):
    one = run_one(monkeypatch, options(tmp_path, tmp_path / "one", per_device_train_batch_size=8))
    # 4 KB gradient buckets: the 16 KB of adapter gradients travel in several all-reduces
    two = torchrun(tmp_path, options(tmp_path, tmp_path / "two"), XGBLORA_TEST_BUCKET_BYTES="4096")
    assert_close_tensors(load_file(tmp_path / "one" / ADAPTER), load_file(tmp_path / "two" / ADAPTER),
                         rtol=1e-4, atol=1e-6)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert two["world_size"] == 2 and "world_size" not in one
    # per step: the loss, every adapter gradient (fp32) and the stop flag, in one process's payload
    assert two["allreduce_bytes_per_step"] == 4 * (1 + two["trainable_params"] + 1)


@pytest.mark.slow
def test_adamw_xgblora_with_layer_sampling_on_two_ranks_equals_one_rank_and_resumes(tmp_path, monkeypatch):
    """Boosters on one random layer of two: requires_grad flips between boosters (DDP could not follow)."""
    values = dict(method="xgblora", xgblora_steps_per_iteration=2, xgblora_layers_per_booster=1)
    run_one(monkeypatch, options(tmp_path, tmp_path / "one", per_device_train_batch_size=8, **values))
    two = torchrun(tmp_path, options(tmp_path, tmp_path / "two", save_steps=3, **values))
    assert two["boosters"] == 3
    # atol 1e-4 (weights up to 0.04, lr 1e-2): AdamW's normalised step moves a weight whose gradient is near zero
    # by up to lr whatever the gradient's size, so the sums' other order moved one such weight of 192 by 1.3e-6
    # on an AMD EPYC and 2e-5 on an Intel Xeon; a wrong share of the gradient would move weights by ~lr
    assert_close_tensors(load_file(tmp_path / "one" / ADAPTER), load_file(tmp_path / "two" / ADAPTER),
                         rtol=1e-4, atol=1e-4)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    # checkpoints are written once, by the main process; step 3's resumes on 2 ranks to the same end, bit for bit
    assert [p.name for p in (tmp_path / "two" / "checkpoints").iterdir()] == ["step-3"]
    torchrun(tmp_path, options(tmp_path, tmp_path / "resumed", resume_from_checkpoint=tmp_path / "two/checkpoints/step-3",
                               **values))
    assert_close_tensors(load_file(tmp_path / "two" / ADAPTER), load_file(tmp_path / "resumed" / ADAPTER),
                         rtol=0, atol=0)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "two")[3:]


@pytest.mark.parametrize("method", ["lora", "ft"], ids=["lora-dual-batch", "ft-two-pass"])
def test_mezo_two_ranks_equal_one_rank_and_send_only_the_losses(tmp_path, monkeypatch, method):
    values = dict(trainer="zo", method=method, learning_rate=1e-3, zo_eps=1e-2, max_steps=8)
    run_one(monkeypatch, options(tmp_path, tmp_path / "one", per_device_train_batch_size=8, **values))
    two = torchrun(tmp_path, options(tmp_path, tmp_path / "two", **values))
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    final = ADAPTER if method == "lora" else "final/model.safetensors"
    assert_close_tensors(load_file(tmp_path / "one" / final), load_file(tmp_path / "two" / final),
                         rtol=1e-4, atol=1e-6)
    # L+ and L- (fp32) and the stop flag: 12 bytes a step, against 4 bytes per trainable parameter for gradients
    assert (two["allreduce_bytes_per_step"], two["zo_bytes_per_step"]) == (3 * 4, 2 * 4)
    assert two["trainable_params"] * 4 > 1000 * two["allreduce_bytes_per_step"]


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_a_rank_that_dies_or_stalls_stops_the_other_with_a_clear_error(tmp_path, how):
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    values = options(tmp_path, tmp_path / "run", trainer="zo", max_steps=50, ddp_timeout=4)
    port = str(free_port())
    ranks = []
    for rank in range(2):
        env = worker_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port, XGBLORA_TEST_FAIL_AT_STEP="3",
                         XGBLORA_TEST_FAIL_HOW=how)
        ranks.append(subprocess.Popen([sys.executable, str(script), *flags(values)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        _, err = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode not in (0, None)
        assert "rank 0 of 2" in err and "another rank died, was killed or stalled" in err, err[-2000:]
        if how == "exit":
            assert ranks[1].wait(timeout=5) == 17
        else:  # rank 1 is still asleep: rank 0 gave up after --ddp_timeout, not when rank 1 ended
            assert ranks[1].poll() is None
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not (tmp_path / "run" / "results.json").exists()
