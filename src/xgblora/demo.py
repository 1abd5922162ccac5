"""`xgblora demo`: offline, seeded, a few minutes on a laptop CPU — XGBLoRA vs LoRA under AdamW and MeZO, with a report."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from xgblora import compare, outputs
from xgblora.config import CompareConfig, Config
from xgblora.recipes import sft

POSITIVE = ("great", "good", "fun", "funny", "lovely", "superb", "moving", "brilliant")
NEGATIVE = ("bad", "terrible", "boring", "dull", "awful", "weak", "tedious", "bland")
SUBJECTS = ("the movie", "the film", "the story", "the plot", "the cast", "the ending", "this show", "the music")
FILLERS = ("today", "for me", "overall", "at times", "in the end", "to be honest", "again", "by far")
TEMPLATE, LABEL_WORDS = "{text} It was", "terrible,great"


def sentiment_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n generated reviews {"text", "label"}: the polarity of their adjectives decides the label (1 = positive)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randrange(2)
        words = POSITIVE if label else NEGATIVE
        adjectives = rng.sample(words, rng.choice((1, 2)))
        text = f"{rng.choice(SUBJECTS)} was {' and '.join(adjectives)} {rng.choice(FILLERS)}."
        rows.append({"text": text[0].upper() + text[1:], "label": label})
    return rows


def write_data(folder: Path, n_train: int = 576, n_eval: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """Write the demo task's train.jsonl and eval.jsonl (disjoint seeds) into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("train", n_train, seed), ("eval", n_eval, seed + 1)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in sentiment_rows(n, s)), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


def demo_configs(out: Path, steps: int, num_eval: int) -> list[Config]:
    """The runs of the demo: XGBLoRA and LoRA under AdamW (steps) and under MeZO (5 x steps, each far cheaper).

    Every run trains with cross-entropy over the two label words (--train_as_classification): on a random model
    the gold-token loss is dominated by lifting both label words above the other 500 tokens, a direction MeZO's
    random probes find slowly, while the classification loss measures only what the task asks. Adapters run on the
    library's defaults (alpha 2r, XGBLoRA's plain preset), with 5 boosters a run (the demo's measured setting: 60
    AdamW or 300 MeZO steps each at the default length).
    """
    train_file, eval_file = write_data(out / "data")
    common: dict[str, Any] = dict(model_name="tiny-opt", task_name="custom", train_file=str(train_file),
                                  eval_file=str(eval_file), template=TEMPLATE, label_words=LABEL_WORDS,
                                  num_train=512, num_dev=64, num_eval=num_eval, train_as_classification=True,
                                  evaluation_strategy="steps", save_strategy="no", output_root=str(out), seeds=[0],
                                  methods=["xgblora", "lora"])
    adamw = CompareConfig(**common, trainer="regular", max_steps=steps, learning_rate=3e-3,
                          per_device_train_batch_size=16, logging_steps=max(1, steps // 40),
                          eval_steps=max(1, steps // 4), xgblora_steps_per_iteration=max(1, steps // 5))
    zo_steps = 5 * steps
    mezo = CompareConfig(**common, trainer="zo", max_steps=zo_steps, learning_rate=5e-2, zo_eps=1e-2,
                         per_device_train_batch_size=32, logging_steps=max(1, zo_steps // 40),
                         eval_steps=max(1, zo_steps // 4), xgblora_steps_per_iteration=max(1, zo_steps // 5))
    return compare.run_configs(adamw) + compare.run_configs(mezo)


def run_demo(out: Path = Path("xgblora-demo"), steps: int = 300, num_eval: int = 200) -> dict[str, Any]:
    """Run the demo and write its report into out; returns the report paths, rows and the untrained baseline."""
    outputs.check_folder(out, "--output_root", outputs.holds_runs, "runs of xgblora demo")
    configs = demo_configs(out, steps, num_eval)
    baseline_cfg = Config(**{**vars(configs[0]), "trainer": "none", "num_train": 0,
                             "output_dir": str(out / "untrained"), "result_file": str(out / "untrained" / "mezo.json")})
    baseline = sft.run(baseline_cfg)
    done = compare.run_all(configs, out, out / "loss.png")
    return {**done, "untrained_accuracy": baseline["accuracy"]}
