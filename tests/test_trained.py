"""trained.py and `xgblora export --checkpoint`: an interrupted run's checkpoint exports as a PEFT adapter and as a
merged model whose logits (PEFT and transformers, fresh process) equal the live model's at that step; every source
load_for_inference takes gives the same model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xgblora import cli
from xgblora.adapters import trained
from xgblora.config import Config
from xgblora.demo import LABEL_WORDS, TEMPLATE, write_data
from xgblora.errors import UserError
from xgblora.recipes.sft import run
from xgblora.train import Hooks, loop

FRESH = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from xgblora.models import pretrained
ids = torch.load(sys.argv[1], weights_only=True)
peft = PeftModel.from_pretrained(pretrained.load("tiny-llama")[0], sys.argv[2]).eval()
merged = AutoModelForCausalLM.from_pretrained(sys.argv[3]).eval()
with torch.no_grad():
    torch.save({"peft": peft(input_ids=ids).logits, "merged": merged(input_ids=ids).logits}, sys.argv[4])
"""
IDS = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(2))


class Interrupted(Exception):
    """Raised by a hook: the run stops as a crash would, with no final/."""


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """An XGBLoRA run on tiny-llama (booster every 3 steps, checkpoint every 2) stopped after step 5; the live
    model's logits at each checkpoint."""
    tmp = tmp_path_factory.mktemp("interrupted")
    train_file, eval_file = write_data(tmp / "data", n_train=48, n_eval=8)
    out, seen = tmp / "run", {}
    real_save = loop.Trainer._save

    def save(self, name):
        self.run.model.eval()
        with torch.no_grad():
            seen[name] = self.run.model(input_ids=IDS).logits
        self.run.model.train()
        return real_save(self, name)

    def stop(state):
        if state.step == 5:
            raise Interrupted

    mp = pytest.MonkeyPatch()
    mp.setattr(loop.Trainer, "_save", save)
    try:
        with pytest.raises(Interrupted):
            run(Config(model_name="tiny-llama", task_name="custom", train_file=str(train_file),
                       eval_file=str(eval_file), template=TEMPLATE, label_words=LABEL_WORDS, num_train=32, num_eval=8,
                       method="xgblora", xgblora_preset="plain", lora_r=2, xgblora_steps_per_iteration=3,
                       trainer="regular", learning_rate=3e-2, max_steps=20, save_steps=2,
                       per_device_train_batch_size=4, device="cpu", output_dir=str(out)), Hooks([stop]))
    finally:
        mp.undo()
    assert not (out / "final").exists() and sorted(seen) == ["step-2", "step-4"]
    return {"tmp": tmp, "out": out, "seen": seen}


def test_an_interrupted_runs_checkpoint_exports_and_loads_in_a_fresh_process(interrupted: dict) -> None:
    tmp, out = interrupted["tmp"], interrupted["out"]
    for fmt in ("peft", "merged"):
        assert cli.main(["export", str(out), "--checkpoint", "latest", "--format", fmt, "--out", str(tmp / fmt)]) == 0
    torch.save(IDS, tmp / "ids.pt")
    subprocess.run([sys.executable, "-c", FRESH, str(tmp / "ids.pt"), str(tmp / "peft"), str(tmp / "merged"),
                    str(tmp / "logits.pt")], check=True, timeout=120)
    fresh = torch.load(tmp / "logits.pt", weights_only=True)
    live = interrupted["seen"]["step-4"]  # step 4: booster 1 merged at step 3, booster 2 one step in
    assert (live - interrupted["seen"]["step-2"]).abs().max() > 1e-3
    torch.testing.assert_close(fresh["peft"], live, atol=2e-5, rtol=0)
    torch.testing.assert_close(fresh["merged"], live, atol=2e-5, rtol=0)
    record = json.loads((tmp / "peft" / "xgblora_export.json").read_text())
    assert record["source"].endswith("step-4/adapter")


def test_load_for_inference_takes_a_run_folder_an_adapter_folder_or_base_plus_adapter(interrupted: dict) -> None:
    out = interrupted["out"]
    adapter = out / "checkpoints" / "step-4" / "adapter"
    live = interrupted["seen"]["step-4"]
    for args in ((str(out),), (str(adapter),), ("tiny-llama", str(adapter)), ("tiny-llama", str(out))):
        model, tokenizer = trained.load_for_inference(*args)
        assert model.config.use_cache and not model.training and tokenizer.padding_side == "left"
        assert not any(".lora_" in n for n, _ in model.named_parameters())  # merged for speed
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=IDS).logits, live, atol=2e-5, rtol=0)
    model, _ = trained.load_for_inference(str(out), load_in_4bit=True)  # a 4-bit base keeps the adapter attached
    assert any(".lora_" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("spec, message", [("step-3", "no such checkpoint"), ("last", "give step-N, latest or best"),
                                          ("best", "no such checkpoint")])
def test_a_missing_checkpoint_is_a_one_line_error(interrupted: dict, tmp_path: Path, spec: str, message: str) -> None:
    from xgblora.export import export_run

    with pytest.raises(UserError, match=message) as info:
        export_run(interrupted["out"], "peft", tmp_path / "out", checkpoint=spec)
    assert "\n" not in str(info.value)


def test_adapter_and_a_model_that_already_carries_one_is_refused(interrupted: dict) -> None:
    with pytest.raises(UserError, match="already carries an adapter"):
        trained.resolve(str(interrupted["out"]), str(interrupted["out"]))
