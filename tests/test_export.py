"""Exports reproduce the trained model: PEFT adapters (concatenated boosters, SVD) and the merged model, in a fresh process."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import forget_state_in
from safetensors.torch import load_file

from xgblora.adapters.boosting import Boosting
from xgblora.adapters.lora import attach, lora_modules, unwrap
from xgblora.adapters.peft import to_peft
from xgblora.errors import UserError
from xgblora.models import pretrained

MODELS = {"tiny-opt": 1, "tiny-llama": 2}  # model -> booster rank
CHECK = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from xgblora.models import pretrained
out = {}
for case in json.loads(sys.argv[1]):
    if case["kind"] == "merged":
        model = AutoModelForCausalLM.from_pretrained(case["dir"])
        AutoTokenizer.from_pretrained(case["dir"])
    else:
        model = PeftModel.from_pretrained(pretrained.load(case["model"])[0], case["dir"])
    model.eval()
    ref = torch.load(case["logits"], weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=torch.load(case["ids"], weights_only=True)).logits
    out[case["id"]] = {"diff": (logits - ref).abs().max().item(), "scale": ref.abs().max().item()}
    if case["kind"] == "peft":
        with torch.no_grad(), model.disable_adapter():
            out[case["id"]]["base_diff"] = (model(input_ids=torch.load(case["ids"], weights_only=True)).logits - ref).abs().max().item()
print(json.dumps(out))
"""


def _train(name: str, r: int, steps: int, boosting_kwargs: dict | None):
    torch.manual_seed(0)
    model, tokenizer = pretrained.load(name)
    report = attach(model, r=r, alpha=16.0)
    boosting = None
    if boosting_kwargs is not None:
        boosting = Boosting(report.modules, seed=0, **boosting_kwargs)
        boosting.begin()
    opt = torch.optim.AdamW([p for m in report.modules.values() for p in (m.lora_A, m.lora_B)], lr=3e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if boosting is not None:
            boosting.after_step(step, loss.item(), forget_state_in(opt))
    model.eval()
    return model, tokenizer, report.modules, boosting


def _true_deltas(name: str, modules) -> dict[str, torch.Tensor]:
    """W_final - W_0 per module: merged bases minus the original weights, plus the active current adapter."""
    original = dict(pretrained.load(name)[0].named_parameters())
    return {n: m.base.weight.detach() - original[f"{n}.weight"].detach() + (m.delta_weight().detach() if m.active else 0)
            for n, m in modules.items()}


def _peft_deltas(folder) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    out = {}
    for name in config["target_modules"]:
        r = config["rank_pattern"].get(name, config["r"])
        alpha = config["alpha_pattern"].get(name, config["lora_alpha"])
        A, B = tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"]
        assert A.shape[0] == B.shape[1] == r
        out[name] = alpha / r * B @ A
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train, export every way, and check all exports in one fresh process; returns per-run facts and results."""
    root = tmp_path_factory.mktemp("export")
    runs, cases = {}, []
    for name, r in MODELS.items():
        model, tokenizer, modules, boosting = _train(
            name, r, 11, dict(steps_per_iteration=3, layers_per_booster=1, shrinkage=0.7))
        runs[name] = {"model": model, "modules": modules, "boosting": boosting, "dir": root / name}
        runs[f"{name}-lora"] = {"model": _train(name, 4, 3, None)[0], "dir": root / f"{name}-lora"}
    for key, run in runs.items():
        model, folder = run["model"], run["dir"]
        ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            torch.save(model(input_ids=ids).logits, folder.with_suffix(".logits.pt"))
        torch.save(ids, folder.with_suffix(".ids.pt"))
        base_name = key.removesuffix("-lora")
        files = {"ids": str(folder.with_suffix(".ids.pt")), "logits": str(folder.with_suffix(".logits.pt"))}
        if key.endswith("-lora"):
            run["result"] = to_peft(lora_modules(model), [], folder / "peft", base_name)
            cases.append({"id": f"{key}/peft", "kind": "peft", "model": base_name, "dir": str(folder / "peft"), **files})
            continue
        history = run["boosting"].history
        run["concat"] = to_peft(run["modules"], history, folder / "concat", base_name)
        run["svd8"] = to_peft(run["modules"], history, folder / "svd8", base_name, rank=8)
        run["svd1"] = to_peft(run["modules"], history, folder / "svd1", base_name, rank=1)
        run["without_current"] = to_peft(run["modules"], history, folder / "nocur", base_name,
                                                include_current=False)
        run["true"] = _true_deltas(base_name, run["modules"])
        merged = copy.deepcopy(model)
        unwrap(merged)  # every adapter merged into its base weights
        merged.save_pretrained(folder / "merged")
        pretrained.tiny_tokenizer().save_pretrained(folder / "merged")
        for kind in ("concat", "svd8", "merged"):
            cases.append({"id": f"{key}/{kind}", "kind": "peft" if kind != "merged" else "merged",
                          "model": base_name, "dir": str(folder / kind), **files})
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return runs, results


@pytest.mark.parametrize("name", list(MODELS))
def test_boosters_were_merged_with_layer_sampling(runs, name):
    run = runs[0][name]
    assert [h["step"] for h in run["boosting"].history] == [3, 6, 9]
    assert all(len(h["modules"]) == 2 for h in run["boosting"].history)
    assert any(m.lora_B.abs().max() > 0 for m in run["modules"].values())  # a current, un-merged booster too


@pytest.mark.parametrize("name", list(MODELS))
def test_concatenated_export_reproduces_logits_in_peft(runs, name):
    run, results = runs[0][name], runs[1]
    deltas = _peft_deltas(run["dir"] / "concat")
    assert set(deltas) == {n for n, d in run["true"].items() if d.abs().max() > 0}
    for n, d in deltas.items():
        torch.testing.assert_close(d, run["true"][n], rtol=1e-4, atol=1e-6)
    config = json.loads((run["dir"] / "concat" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == name
    assert run["concat"]["retained_energy"] is None and run["concat"]["modules"] == len(deltas)
    res = results[f"{name}/concat"]
    assert res["diff"] < 1e-4 * max(res["scale"], 1.0), res
    assert res["base_diff"] > 100 * res["diff"]  # without the adapter PEFT's logits are far off


@pytest.mark.parametrize("name", list(MODELS))
def test_export_without_current_adapter_is_the_merged_boosters(runs, name):
    run = runs[0][name]
    for n, d in _peft_deltas(run["dir"] / "nocur").items():
        m = run["modules"][n]
        expected = run["true"][n] - (m.delta_weight().detach() if m.active else 0)
        torch.testing.assert_close(d, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_svd_export_exact_when_rank_suffices(runs, name):
    run, results = runs[0][name], runs[1]
    assert run["svd8"]["rank"] == 8 and run["svd8"]["retained_energy"] == pytest.approx(1.0, abs=1e-9)
    for n, d in _peft_deltas(run["dir"] / "svd8").items():
        torch.testing.assert_close(d, run["true"][n], rtol=1e-4, atol=1e-6)
    res = results[f"{name}/svd8"]
    assert res["diff"] < 1e-4 * max(res["scale"], 1.0), res


@pytest.mark.parametrize("name", list(MODELS))
def test_svd_export_low_rank_energy(runs, name):
    run = runs[0][name]
    result = run["svd1"]
    kept = total = 0.0
    for n, energy in result["retained_energy_per_module"].items():
        s = torch.linalg.svdvals(run["true"][n].double())
        assert energy == pytest.approx(float(s[0] ** 2 / (s ** 2).sum()), rel=1e-4)
        kept, total = kept + float(s[0] ** 2), total + float((s ** 2).sum())
    assert result["retained_energy"] < 1.0
    assert result["retained_energy"] == pytest.approx(kept / total, rel=1e-4)
    for n, d in _peft_deltas(run["dir"] / "svd1").items():  # the best rank-1 approximation (Eckart-Young)
        u, s, vh = torch.linalg.svd(run["true"][n].double())
        torch.testing.assert_close(d.double(), s[0] * torch.outer(u[:, 0], vh[0]), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_merged_export_loads_with_transformers(runs, name):
    run, results = runs[0][name], runs[1]
    assert (run["dir"] / "merged" / "model.safetensors").is_file()
    res = results[f"{name}/merged"]
    assert res["diff"] < 1e-4 * max(res["scale"], 1.0), res


@pytest.mark.parametrize("name", list(MODELS))
def test_plain_lora_export(runs, name):
    run, results = runs[0][f"{name}-lora"], runs[1]
    config = json.loads((run["dir"] / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["rank_pattern"] == {} and config["alpha_pattern"] == {}
    assert run["result"] == {"rank": 4, "modules": 4, "retained_energy": None, "retained_energy_per_module": None}
    res = results[f"{name}-lora/peft"]
    assert res["diff"] < 1e-4 * max(res["scale"], 1.0), res


def test_export_argument_errors(tmp_path):
    model, _ = pretrained.load("tiny-opt")
    modules = attach(model, r=2).modules
    with pytest.raises(UserError, match="rank"):
        to_peft(modules, [], tmp_path, "tiny-opt", rank=0)
    stray = [{"booster": 1, "step": 1, "modules": {"lm_head": {"A": torch.zeros(1, 64), "B": torch.zeros(8, 1), "scale": 1.0}}}]
    with pytest.raises(UserError, match="lm_head"):
        to_peft(modules, stray, tmp_path, "tiny-opt")
    result = to_peft(modules, [], tmp_path, "tiny-opt")  # untrained: a zero-effect adapter that still loads
    assert result["modules"] == 4 and result["rank"] == 2
