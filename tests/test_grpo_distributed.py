"""`xgblora grpo` data-parallel on the CPU with gloo: 2 ranks train exactly like 1 process on the same global
generation batch (whole groups per rank, the dapo normaliser and the batch std over both ranks, the held-out
prompts shared out), resume exactly, and refuse a generation batch that does not split over the ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import completion_batch
from helpers import assert_close_tensors, free_port, worker_env
from safetensors.torch import load_file

from xgblora.config import GRPOConfig
from xgblora.distributed import LOCAL
from xgblora.errors import UserError
from xgblora.generation.grpo_batches import Generation, GenerationBuffer, Plan
from xgblora.logs import read_metrics
from xgblora.recipes.grpo import run_grpo

# One rank of a test run. Its sampler is replaced by one whose completions (of random lengths and tokens) depend
# only on the prompt, the generation batch (read from the sampling seed) and the sample's number, never on the rank
# or the batch it is drawn in: so 2 ranks and 1 process see the same completions, and the comparison tests everything after sampling. The
# training sampler's seed on each rank is appended to XGBLORA_TEST_SEEDS.RANK. These variables are read here only.
WORKER = '''
import hashlib, os, sys
import torch
from xgblora import cli
from xgblora.generation import rollout
from xgblora.models.sampler import Sample

def fixed_samples(self, prompt_ids, params, seeds=None, on_rows=None):
    if params.temperature > 0:  # training, not the greedy held-out pass
        with open(f"{os.environ['XGBLORA_TEST_SEEDS']}.{os.environ['RANK']}", "a") as seeds:
            seeds.write(f"{params.seed}\\n")
    # a training seed is (base + generation batch) x ranks + rank; the greedy held-out pass is batch -1
    batch = params.seed // int(os.environ["WORLD_SIZE"]) if params.temperature > 0 else -1
    drawn = []
    for ids_of_prompt in prompt_ids:
        group = []
        for j in range(params.num_samples):
            key = hashlib.sha256(f"{list(ids_of_prompt)}:{batch}:{j}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
            n = int(torch.randint(1, params.max_new_tokens + 1, (1,), generator=g))
            ids = tuple(torch.randint(3, 200, (n,), generator=g).tolist())
            stop = self.tokenizer.eos_token_id if n < params.max_new_tokens else None
            group.append(Sample(ids, "stop" if stop is not None else "length", 0.0, stop))
        drawn.append(group)
    return drawn

rollout.Rollout.draw = fixed_samples
sys.exit(cli.main(["grpo", *sys.argv[1:]]))
'''
ADAPTER = "final/adapter_model.safetensors"
# A rank that samples with the policy itself (--zo_objective reward: the members' completions are the point).
POLICY_WORKER = "import sys\nfrom xgblora import cli\nsys.exit(cli.main(['grpo', *sys.argv[1:]]))\n"


@pytest.fixture
def data(tmp_path):
    (tmp_path / "parity_reward.py").write_text(
        "def odd_first(completion_ids, **kwargs):\n    return [float(ids[0] % 2) for ids in completion_ids]\n")
    rows = [{"question": f"Which is larger, {a} or {a + b}?", "answer": f"#### {a + b}"}
            for a, b in [(1, 2), (3, 4), (5, 1), (7, 3), (2, 8), (9, 5), (4, 4), (6, 2), (8, 1), (0, 7)]]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:7]))
    (tmp_path / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[7:]))  # 3: shards of 2 and 1
    return tmp_path


def options(data: Path, out: str, **overrides) -> dict:
    """4 prompts x G = 4 per generation batch (2 prompts per rank), served twice (num_iterations 2)."""
    values = dict(model_name="tiny-llama", train_file=str(data / "q.jsonl"), eval_file=str(data / "h.jsonl"),
                  columns="prompt=question,completion=answer", method="lora", learning_rate=1e-2, max_new_tokens=6,
                  num_return_sequences=4, generation_batch_size=16, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, num_iterations=2, beta=0.04, scale_rewards="batch",
                  policy_loss="dapo", max_steps=4, logging_steps=1, save_strategy="no", device="cpu", seed=3,
                  reward_funcs=["gsm8k", "parity_reward:odd_first"], output_dir=str(data / out))
    values.update(overrides)
    return values


def torchrun(data: Path, values: dict, nproc: int, worker: str = WORKER) -> subprocess.CompletedProcess:
    script = data / "worker.py"
    script.write_text(worker, encoding="utf-8")
    args = [a for k, v in values.items() for a in (f"--{k}", *map(str, v if isinstance(v, list) else [v]))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", str(script), *args]
    env = worker_env(XGBLORA_TEST_SEEDS=str(Path(values["output_dir"]).with_suffix(".seeds")),
                     PYTHONPATH=":".join([str(data), *sys.path]))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def trained(data: Path, values: dict, nproc: int, worker: str = WORKER) -> dict:
    """Run to the end; the main process's results.json."""
    done = torchrun(data, values, nproc, worker)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((Path(values["output_dir"]) / "results.json").read_text(encoding="utf-8"))


def logged(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_two_ranks_train_like_one_process_on_the_same_generation_batch_and_resume_exactly(data, monkeypatch):
    # one process takes a micro-batch of 8: its optimizer batch is the 2 ranks' together
    one = trained(data, options(data, "one", per_device_train_batch_size=8), nproc=1)
    two = trained(data, options(data, "two", save_strategy="steps", save_steps=1), nproc=2)
    assert_close_tensors(load_file(data / "one" / ADAPTER), load_file(data / "two" / ADAPTER), atol=1e-5, rtol=0)
    assert any(t.abs().sum() > 0 for k, t in load_file(data / "one" / ADAPTER).items() if "lora_B" in k)  # trained
    for a, b in zip(logged(data / "one"), logged(data / "two"), strict=True):
        for key in ("loss", "reward", "reward_std", "completion_length", "accuracy", "frac_reward_zero_std"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    for key in ("before_eval_reward", "eval_reward", "generation_batches"):
        assert one[key] == pytest.approx(two[key]), key
    assert two["world_size"] == 2 and "world_size" not in one
    seeds = [set((data / f"two.seeds.{rank}").read_text().split()) for rank in (0, 1)]
    assert seeds[0] and not seeds[0] & seeds[1]  # each rank samples from its own stream

    # from step 1, in the middle of the first generation batch (each rank's share of it is in the checkpoint)
    step_1 = str(data / "two/checkpoints/step-1")
    resumed = trained(data, options(data, "resumed", resume_from_checkpoint=step_1), nproc=2)
    assert resumed["resumes"] == 1
    assert_close_tensors(load_file(data / "two" / ADAPTER), load_file(data / "resumed" / ADAPTER), atol=0, rtol=0)

    monkeypatch.syspath_prepend(str(data))
    with pytest.raises(UserError, match="generation batches of 2 processes; resume it with 2 processes, not 1"):
        run_grpo(GRPOConfig(**options(data, "alone", resume_from_checkpoint=step_1)))


@pytest.mark.slow
def test_mezo_two_ranks_equal_one_process(data):
    """MeZO: the same perturbations on both ranks, and the mean of their losses is the one process's loss."""
    values = dict(trainer="zo", learning_rate=1e-2, max_steps=3, gradient_accumulation_steps=1)
    trained(data, options(data, "one", per_device_train_batch_size=16, **values), nproc=1)
    trained(data, options(data, "two", per_device_train_batch_size=8, **values), nproc=2)
    assert_close_tensors(load_file(data / "one" / ADAPTER), load_file(data / "two" / ADAPTER), atol=1e-5, rtol=0)
    assert [r["loss"] for r in logged(data / "one")] == pytest.approx([r["loss"] for r in logged(data / "two")],
                                                                      abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("sampling, members", [("antithetic", 6), ("independent", 3)])
def test_es_with_its_members_spread_over_two_ranks_equals_one_process(data, sampling, members):
    """--zo_es_spread members: each rank scores its share of the population (seeds 0 and 2 on rank 0, seed 1 on rank
    1) on all of the step's prompts, sampled with one seed; one all-reduce of the population's fp32 losses is all
    that crosses the network, and both ranks end with the one process's adapter (theirs sampling 2 members at a
    time, --zo_member_batch 2)."""
    (data / "graded_reward.py").write_text(
        "def first_mod7(completion_ids, **kwargs):\n    return [float(ids[0] % 7) for ids in completion_ids]\n")
    values = dict(model_name="tiny-llama", train_file=str(data / "q.jsonl"), columns="prompt=question,completion=answer",
                  method="lora", trainer="zo", zo_objective="reward", zo_estimator="es", zo_es_sampling=sampling,
                  zo_queries=3, zo_eps=0.05, learning_rate=0.02, num_return_sequences=2, max_new_tokens=4,
                  per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=2, logging_steps=1,
                  save_strategy="no", device="cpu", seed=3, reward_funcs=["graded_reward:first_mod7"])
    trained(data, dict(values, output_dir=str(data / "one")), 1, POLICY_WORKER)
    two = trained(data, dict(values, output_dir=str(data / "two"), zo_es_spread="members", zo_member_batch=2), 2,
                  POLICY_WORKER)
    assert_close_tensors(load_file(data / "one" / ADAPTER), load_file(data / "two" / ADAPTER), atol=1e-5, rtol=0)
    assert any(t.abs().sum() > 0 for k, t in load_file(data / "two" / ADAPTER).items() if "lora_B" in k)  # trained
    for a, b in zip(logged(data / "one"), logged(data / "two"), strict=True):
        for key in ("loss", "reward", "member_reward_std", "completion_length"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert any(r["member_reward_std"] > 0 for r in logged(data / "two"))  # the members scored differently
    # the population's losses (fp32) and the 4-byte stop flag, nothing else
    assert (two["world_size"], two["zo_bytes_per_step"], two["allreduce_bytes_per_step"]) == \
        (2, 4 * members, 4 * members + 4)


def test_a_generation_batch_that_does_not_split_over_the_ranks_is_a_one_line_error(data):
    odd = options(data, "odd", generation_batch_size=12, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    done = torchrun(data, odd, nproc=2)  # 3 prompts
    errors = [line for line in done.stderr.splitlines() if line.startswith("xgblora grpo: error:")]
    # torchrun stops the other process once one exits, so it may or may not have written its line: each line is
    # whole (never interleaved with the other's) and says the same.
    assert errors and set(errors) == {"xgblora grpo: error: the generation batch's 3 prompts (--generation_batch_size "
                                      "12 / --num_generations 4) do not split evenly over 2 processes; make the "
                                      "prompt count a multiple of 2"}
    assert "exitcode  : 2" in done.stderr and not (data / "odd" / "config.yaml").exists()
    assert "trainable parameters" not in done.stderr  # refused before either process set up the model


def test_the_generation_buffer_round_trips_its_batch_and_counters():
    buffer = GenerationBuffer(LOCAL, torch.device("cpu"))
    batch = completion_batch([(0, [5, 6], [7, 8]), (0, [5, 6], [9])], pad_id=0)
    buffer.current, buffer.cycle, buffer.generations = Generation(batch, {"reward": 0.5}), 3, 4
    restored = GenerationBuffer(LOCAL, torch.device("cpu"))
    restored.load_state_dict(buffer.state_dict())
    assert restored.current.metrics == {"reward": 0.5} and (restored.cycle, restored.generations) == (3, 4)
    torch.testing.assert_close(restored.current.batch.input_ids, batch.input_ids)
    with pytest.raises(UserError, match="generation batches of 2 processes; resume it with 2 processes, not 1"):
        restored.load_state_dict({**buffer.state_dict(), "ranks": [{}, {}]})


def test_the_generation_batch_spans_the_processes_and_splits_into_their_optimizer_batches():
    cfg = GRPOConfig(train_file="x", num_return_sequences=4, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, steps_per_generation=4)
    plan = Plan.of(cfg, 2)
    assert (plan.generation, plan.prompts, plan.local, plan.step, plan.steps_per_generation) == (32, 8, 16, 8, 2)
    with pytest.raises(UserError, match=r"--generation_batch_size 16 must be a multiple of the optimizer batch of all "
                                        r"processes, .* x 4 processes = 32$"):
        Plan.of(GRPOConfig(train_file="x", num_return_sequences=4, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, generation_batch_size=16), 4)
