"""`xgblora rft` data-parallel on the CPU with gloo: 2 ranks of per-device batch 2 sample, keep and train like 1
process of batch 4 (each question samples from its own seed, whatever process or batch samples it), and a 2-rank
run stopped in the middle of a round's training continues, run again, to the uninterrupted run's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_close_tensors, flags, free_port, worker_env
from safetensors.torch import load_file

from xgblora.generation.generate import Prompts, read_prompts
from xgblora.models import pretrained
from xgblora.models.sampler import SamplingParams
from xgblora.recipes.rft import LoadedModel, Questions, sample_questions

# A random model of 512 tokens rarely draws its one stop token: in the test runs 48 more tokens stop a completion,
# so about half of them finish (a completion cut off by max_new_tokens is never kept).
WORKER = """
import sys
from xgblora import cli
from xgblora.data import formats

stop_ids = formats.model_stop_ids
formats.model_stop_ids = lambda model, tokenizer: [*stop_ids(model, tokenizer), *range(2, 50)]
"""
# Rank 0 is sent SIGTERM after the second step of round 1's training, as Ctrl-C would be: every rank stops after
# that step, with a checkpoint.
STOPPING_WORKER = WORKER + """
import os, signal
from xgblora.train import loop

train_step = loop.Trainer.train_step

def stopping_step(self):
    done = train_step(self)
    if self.state.step == 2 and os.environ["RANK"] == "0" and "round-1" in self.cfg.output_dir:
        os.kill(os.getpid(), signal.SIGTERM)
    return done

loop.Trainer.train_step = stopping_step
"""
RUN = "sys.exit(cli.main(['rft', *sys.argv[1:]]))\n"
# A random model's answers are never right: this verifier calls a completion of an even number of words right
# (the references, "#### n", have two), so about half of the finished completions are kept (none empty: the
# training rows refuse an empty completion).
VERIFIER = "def words(text):\n    return str(len(text.split()) % 2) if text.split() else None\n"
ROUNDS = (1, 2)


@pytest.fixture
def data(tmp_path) -> Path:
    pairs = [(a, b) for a in range(1, 6) for b in range(1, 6) if a != b]
    rows = [{"question": f"Which is larger, {a} or {b}?", "answer": f"#### {max(a, b)}"} for a, b in pairs]
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:11]))  # shares of 2 and 1
    (tmp_path / "even_words.py").write_text(VERIFIER)
    return tmp_path


def options(data: Path, out: str, **overrides) -> dict:
    """--loss_mean example: ranks are averaged with equal weight, which is the global batch's mean of each row's mean
    (the token mean of instruction data would weigh each rank's tokens alike, not each token)."""
    values = dict(model_name="tiny-llama", train_file=str(data / "questions.jsonl"),
                  eval_file=str(data / "heldout.jsonl"), columns="prompt=question,completion=answer",
                  verifier="even_words:words", rounds=len(ROUNDS), num_return_sequences=4, temperature=1.0,
                  max_new_tokens=6, max_batch_tokens=120, pass_k=2, pass_n=3, method="lora", learning_rate=3e-3,
                  per_device_train_batch_size=2, max_steps=4, logging_steps=1, save_strategy="no", device="cpu",
                  seed=3, loss_mean="example", output_root=str(data / out))
    return {**values, **overrides}


def torchrun(data: Path, values: dict, nproc: int, worker: str = WORKER) -> subprocess.CompletedProcess:
    script = data / "worker.py"
    script.write_text(worker + RUN, encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", str(script), *flags(values)]
    env = worker_env(PYTHONPATH=":".join([str(data), *sys.path]))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def finished(data: Path, values: dict, nproc: int) -> list[dict]:
    """Run to the end; the rounds' records (rounds.json)."""
    done = torchrun(data, values, nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((Path(values["output_root"]) / "rounds.json").read_text(encoding="utf-8"))


def adapters(root: Path) -> list[dict]:
    return [load_file(root / f"round-{n}" / "run" / "final" / "adapter_model.safetensors") for n in ROUNDS]


def text(root: Path, name: str) -> str:
    return (root / name).read_text(encoding="utf-8")


@pytest.mark.slow
def test_two_ranks_keep_and_train_like_one_process_of_their_global_batch_and_resume_exactly(data):
    one = finished(data, options(data, "one", per_device_train_batch_size=4), nproc=1)
    two = finished(data, options(data, "two"), nproc=2)
    for n in ROUNDS:  # the same completions, so the same rows kept
        for name in ("samples.jsonl", "verified.jsonl", "train.jsonl", "eval-greedy.jsonl", "eval-samples.jsonl"):
            assert text(data / "one" / f"round-{n}", name) == text(data / "two" / f"round-{n}", name), (n, name)
    assert [r["kept"] for r in one[1:]] == [r["kept"] for r in two[1:]] and all(r["kept"] > 0 for r in one[1:])
    assert json.dumps(one) == json.dumps(two).replace(str(data / "two"), str(data / "one"))  # the same scores
    for a, b in zip(adapters(data / "one"), adapters(data / "two"), strict=True):
        assert any(t.abs().sum() > 0 for k, t in a.items() if "lora_B" in k)  # trained
        assert_close_tensors(a, b, atol=1e-5, rtol=0)
    assert not list((data / "two").glob("round-*/*.rank-*"))  # each process's share went into the whole file

    stopped = torchrun(data, options(data, "resumed"), nproc=2, worker=STOPPING_WORKER)
    assert stopped.returncode != 0 and "stopped at step 2" in stopped.stderr
    assert not (data / "resumed" / "round-1" / "model").exists()
    finished(data, options(data, "resumed"), nproc=2)  # the same command again
    assert json.loads(text(data / "resumed" / "round-1" / "run", "results.json"))["resumes"] == 1
    for a, b in zip(adapters(data / "two"), adapters(data / "resumed"), strict=True):
        assert_close_tensors(a, b, atol=0, rtol=0)
    assert text(data / "two", "rounds.json") == \
        text(data / "resumed", "rounds.json").replace(str(data / "resumed"), str(data / "two"))


def test_a_question_samples_the_same_completions_in_any_batch_position_or_share(tmp_path):
    """Each question's seed is named by the run's seed, the file and the question's index: sampled among all the
    questions, or as another process's share in another order and batches, it draws the same completions; the
    same question in another file (another round, or the hinted pass) draws others."""
    rows = [{"question": f"Which is larger, {a} or {a + 2}?", "answer": f"#### {a + 2}"} for a in range(6)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tokenizer = pretrained.load("tiny-llama")
    loaded = LoadedModel("tiny-llama", model, tokenizer)
    prompts = read_prompts(str(tmp_path / "q.jsonl"), tokenizer, columns="prompt=question,completion=answer")
    n = len(prompts.ids)

    def sampled(numbers: list[int], max_batch_tokens: int, out: str) -> dict[int, list[str]]:
        share = Questions("q.jsonl", Prompts([prompts.rows[i] for i in numbers], [prompts.examples[i] for i in numbers],
                                             [prompts.ids[i] for i in numbers]), [[] for _ in numbers], numbers)
        params = SamplingParams(num_samples=3, max_new_tokens=6, temperature=1.0, seed=3,
                                max_batch_tokens=max_batch_tokens)
        drawn = sample_questions(loaded, share, params, tmp_path / out)
        return {i: row["completions"] for i, row in zip(numbers, drawn, strict=True)}

    together = sampled(list(range(n)), 10_000, "a/round-1/samples.jsonl")
    assert sampled([5, 3, 1], 1, "b/round-1/samples.jsonl") == {i: together[i] for i in (5, 3, 1)}
    assert sampled([4, 0, 2], 3 * 2 * 30, "c/round-1/samples.jsonl") == {i: together[i] for i in (4, 0, 2)}
    for elsewhere in ("d/round-2/samples.jsonl", "e/round-1/hinted.jsonl"):
        other = sampled(list(range(n)), 10_000, elsewhere)
        assert all(other[i] != together[i] for i in range(n))
