"""--adapter: a LoRA adapter trained by PEFT itself loads exactly into xgblora's layers (LoRA, and XGBLoRA's first
booster), trains on, and what xgblora writes loads back in PEFT with the same logits in a fresh process; eval
takes the adapter (or a run folder) and scores what the merged model scores."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, PeftModel, get_peft_model

from xgblora.adapters import trained
from xgblora.adapters.peft import read_adapter
from xgblora.config import Config
from xgblora.demo import LABEL_WORDS, TEMPLATE, write_data
from xgblora.export import export_run
from xgblora.models import pretrained
from xgblora.recipes.sft import run
from xgblora.train.setup import setup_method

PEFT_LOGITS = """
import json, sys, torch
from peft import PeftModel
from xgblora.models import pretrained
base = pretrained.load("tiny-llama")[0]
model = PeftModel.from_pretrained(base, sys.argv[1]).eval()
with torch.no_grad():
    logits = model(input_ids=torch.load(sys.argv[2], weights_only=True)).logits
torch.save(logits, sys.argv[3])
"""

IDS = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory) -> Path:
    """A rank-4 rsLoRA adapter on q/v/o of tiny-llama, trained 5 AdamW steps by PEFT itself (B far from zero)."""
    folder = tmp_path_factory.mktemp("peft") / "adapter"
    base = pretrained.load("tiny-llama")[0]
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True,
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 400, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder)
    return folder


def _peft_logits(folder: Path, tmp: Path) -> torch.Tensor:
    """The logits PEFT computes for IDS with this adapter on tiny-llama, in a fresh process."""
    torch.save(IDS, tmp / "ids.pt")
    subprocess.run([sys.executable, "-c", PEFT_LOGITS, str(folder), str(tmp / "ids.pt"), str(tmp / "out.pt")],
                   check=True, timeout=120)
    return torch.load(tmp / "out.pt", weights_only=True)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("method", ["lora", "xgblora"])
def test_a_peft_adapter_loads_exactly_into_xgblora_layers(peft_adapter: Path, method: str) -> None:
    reference = _logits(PeftModel.from_pretrained(pretrained.load("tiny-llama")[0], peft_adapter))
    model = pretrained.load("tiny-llama")[0]
    plain = _logits(pretrained.load("tiny-llama")[0])
    m = setup_method(model, Config(model_name="tiny-llama", adapter=str(peft_adapter), method=method))
    assert set(m.modules) == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj",
                                                                                              "o_proj")}
    if method == "lora":  # the adapter's own rank and rsLoRA scale, trained from there
        assert {mod.r for mod in m.modules.values()} == {4}
        assert all(abs(mod.scaling - 6 / 2) < 1e-12 for mod in m.modules.values())
    else:  # merged into the base as booster 1, the fresh rank-1 booster on top at zero
        assert len(m.boosting.history) == 1 and m.boosting.history[0]["step"] == 0
    assert (reference - plain).abs().max() > 1e-2  # the adapter changes the model
    torch.testing.assert_close(_logits(model), reference, atol=2e-6, rtol=0)


def _train_on(peft_adapter: Path, tmp: Path, method: str) -> Path:
    train_file, eval_file = write_data(tmp / "data", n_train=48, n_eval=8)
    out = tmp / method
    extra = dict(xgblora_steps_per_iteration=2, xgblora_preset="plain") if method == "xgblora" else {}
    run(Config(model_name="tiny-llama", adapter=str(peft_adapter), task_name="custom", train_file=str(train_file),
               eval_file=str(eval_file), template=TEMPLATE, label_words=LABEL_WORDS, num_train=32, num_eval=8,
               method=method, trainer="regular", learning_rate=1e-2, max_steps=5, per_device_train_batch_size=4,
               save_strategy="no", no_eval=True, device="cpu", output_dir=str(out), **extra))
    return out


@pytest.mark.parametrize("method", ["lora", "xgblora"])
def test_training_continues_from_a_peft_adapter_and_loads_back_in_peft(peft_adapter: Path, tmp_path: Path,
                                                                      method: str) -> None:
    out = _train_on(peft_adapter, tmp_path, method)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["model_name"] == "tiny-llama" and cfg["adapter"] == str(peft_adapter)
    ours = _logits(trained.load_for_inference(str(out))[0])  # xgblora's loader: merged into the base
    peft = _peft_logits(out / "final", tmp_path)  # PEFT's loader in a fresh process
    torch.testing.assert_close(peft, ours, atol=2e-5, rtol=0)
    start, final = read_adapter(peft_adapter)[0], read_adapter(out / "final")[0]
    for name, (A0, _, _) in start.items():
        A = final[name][0]
        if method == "lora":  # trained on from the adapter's A: 5 AdamW steps move an entry by about 5 lr at most
            assert 0 < (A - A0).abs().max() < 5 * 1e-2 * 1.05
        else:  # booster 1 is the adapter, exactly; then two merged rank-1 boosters and the current one
            assert A.shape[0] == 4 + 2 + 1 and torch.equal(A[:4], A0)


def test_eval_takes_an_adapter_or_a_run_folder_and_scores_the_merged_model(peft_adapter: Path,
                                                                         tmp_path: Path) -> None:
    train_file, eval_file = write_data(tmp_path / "data", n_train=16, n_eval=16)
    common = dict(task_name="custom", train_file=str(train_file), eval_file=str(eval_file), template=TEMPLATE,
                  label_words=LABEL_WORDS, num_train=0, num_eval=16, trainer="none", device="cpu")
    out = _train_on(peft_adapter, tmp_path, "lora")
    export_run(out, "merged", tmp_path / "merged")
    scores = {}
    for name, source in {"adapter": dict(model_name="tiny-llama", adapter=str(out / "final")),
                         "run": dict(model_name=str(out)), "merged": dict(model_name=str(tmp_path / "merged")),
                         "base": dict(model_name="tiny-llama")}.items():
        result = run(Config(output_dir=str(tmp_path / f"eval-{name}"), **source, **common))
        scores[name] = result["accuracy"]
    assert scores["adapter"] == scores["run"] == scores["merged"]
