"""`xgblora export` of a finished run: PEFT adapters (as trained, SVD-compressed) and merged models, in a fresh process."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import KILLED, run_dying_on_write
from safetensors.torch import load_file

from xgblora import cli
from xgblora.config import Config
from xgblora.demo import LABEL_WORDS, TEMPLATE, write_data
from xgblora.errors import UserError
from xgblora.export import EXPORT_RECORD, FORMATS, export_run
from xgblora.models import gguf_export, pretrained
from xgblora.recipes.sft import run

CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from xgblora.models import pretrained
out = {}
for case in json.loads(sys.argv[1]):
    if case["kind"] == "merged":
        model = AutoModelForCausalLM.from_pretrained(case["dir"])
    else:
        from peft import PeftModel
        model = PeftModel.from_pretrained(pretrained.load(case["model"])[0], case["dir"])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.load(case["ids"], weights_only=True)).logits
    out[case["id"]] = (logits - torch.load(case["logits"], weights_only=True)).abs().max().item()
print(json.dumps(out))
"""


def _train(tmp: Path, method: str) -> Path:
    """A tiny finished run (AdamW, 10 steps; xgblora merges every 3 steps, rank-2 boosters) in tmp/method."""
    train_file, eval_file = write_data(tmp / "data", n_train=64, n_eval=8)
    out = tmp / method
    extra = dict(lora_r=2, xgblora_steps_per_iteration=3, learning_rate=3e-2) if method == "xgblora" else \
        dict(learning_rate=1e-3)
    run(Config(model_name="tiny-opt", task_name="custom", train_file=str(train_file), eval_file=str(eval_file),
               template=TEMPLATE, label_words=LABEL_WORDS, num_train=32, num_eval=8, method=method,
               trainer="regular", max_steps=10 if method == "xgblora" else 2, per_device_train_batch_size=4,
               save_strategy="no", no_eval=True, device="cpu", output_dir=str(out), **extra))
    return out


def _deltas(final: Path) -> dict[str, torch.Tensor]:
    """Each module's scaling * B @ A, read by hand from the PEFT files (r/alpha with their patterns)."""
    config = json.loads((final / "adapter_config.json").read_text())
    tensors = load_file(str(final / "adapter_model.safetensors"))
    deltas = {}
    for key, A in tensors.items():
        if key.endswith(".lora_A.weight"):
            name = key[len("base_model.model."):-len(".lora_A.weight")]
            r = config["rank_pattern"].get(name, config["r"])
            alpha = config["alpha_pattern"].get(name, config["lora_alpha"])
            B = tensors[key.replace("lora_A", "lora_B")]
            deltas[name] = alpha / r * (B.double() @ A.double())
    return deltas


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The xgblora and ft runs, fixed input ids, and the base and reference (base + deltas) logits."""
    tmp = tmp_path_factory.mktemp("export_run")
    xgb, ft = _train(tmp, "xgblora"), _train(tmp, "ft")
    deltas = _deltas(xgb / "final")
    model, _ = pretrained.load("tiny-opt")
    model.eval()
    ids = torch.randint(3, 400, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(input_ids=ids).logits
        for name, delta in deltas.items():
            weight = model.get_submodule(name).weight
            weight.copy_((weight.double() + delta).float())
        ref = model(input_ids=ids).logits
    torch.save(ids, tmp / "ids.pt")
    torch.save(ref, tmp / "ref.pt")
    return {"tmp": tmp, "xgb": xgb, "ft": ft, "deltas": deltas, "base": base, "ref": ref}


def test_exports_reproduce_the_trained_model_in_a_fresh_process(runs: dict) -> None:
    if importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed (pip install -e .[dev])")
    tmp, xgb = runs["tmp"], runs["xgb"]
    assert (runs["ref"] - runs["base"]).abs().max() > 1e-3  # the adapter does change the model
    true_rank = max(int(torch.linalg.matrix_rank(d)) for d in runs["deltas"].values())
    assert true_rank > 2  # several boosters, concatenated
    plain = export_run(xgb, "peft", tmp / "peft")
    assert plain["format"] == "peft" and plain["modules"] == len(runs["deltas"]) and plain["retained_energy"] is None
    svd = export_run(xgb, "peft", tmp / "peft_svd", rank=true_rank)
    assert svd["rank"] == true_rank and svd["retained_energy"] == pytest.approx(1.0, abs=1e-6)
    assert svd["retained_energy_min"] == pytest.approx(1.0, abs=1e-6)
    merged = export_run(xgb, "merged", tmp / "merged")
    assert merged["format"] == "merged" and (tmp / "merged" / "model.safetensors").is_file()
    ft_merged = export_run(runs["ft"], "merged", tmp / "ft_merged")
    assert ft_merged["modules"] == 0
    files = {"ids": str(tmp / "ids.pt"), "logits": str(tmp / "ref.pt"), "model": "tiny-opt"}
    cases = [{"id": "peft", "kind": "peft", "dir": str(tmp / "peft"), **files},
             {"id": "peft_svd", "kind": "peft", "dir": str(tmp / "peft_svd"), **files},
             {"id": "merged", "kind": "merged", "dir": str(tmp / "merged"), **files}]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = json.loads(done.stdout.strip().splitlines()[-1])
    scale = runs["ref"].abs().max().item()
    for key, diff in diffs.items():
        assert diff < 1e-4 * max(scale, 1.0), (key, diff)
    # the full-FT export is the run's own final model, files and all
    assert (tmp / "ft_merged" / "config.json").is_file()
    assert load_file(str(tmp / "ft_merged" / "model.safetensors")).keys() == \
        load_file(str(runs["ft"] / "final" / "model.safetensors")).keys()


def test_rank_one_retained_energy_matches_svdvals(runs: dict) -> None:
    result = export_run(runs["xgb"], "peft", runs["tmp"] / "peft_r1", rank=1)
    kept, total, per_module = 0.0, 0.0, {}
    for name, delta in runs["deltas"].items():
        s2 = torch.linalg.svdvals(delta).square()
        kept, total = kept + s2[0].item(), total + s2.sum().item()
        per_module[name] = (s2[0] / s2.sum()).item()
    assert result["rank"] == 1 and result["modules"] == len(per_module)
    assert result["retained_energy"] < 1
    assert result["retained_energy"] == pytest.approx(kept / total, rel=1e-6)
    assert result["retained_energy_min"] == pytest.approx(min(per_module.values()), rel=1e-6)
    config = json.loads((runs["tmp"] / "peft_r1" / "adapter_config.json").read_text())
    assert config["r"] == 1 and config["rank_pattern"] == {}
    # the written factors are the best rank-1 approximation of each module's delta
    for name, delta in _deltas(runs["tmp"] / "peft_r1").items():
        u, s, vh = torch.linalg.svd(runs["deltas"][name])
        best = s[0] * torch.outer(u[:, 0], vh[0])
        assert (delta - best).abs().max() < 1e-5 * max(best.abs().max().item(), 1e-6)


@pytest.mark.parametrize("case, message", [
    ("missing", "no such run folder"),
    ("no_config", "no config.yaml"),
    ("unfinished", "not finished"),
    ("rank_merged", "--format merged: --rank does not apply"),
    ("rank_zero", "at least 1"),
    ("ft_peft", "full fine-tuning"),
    ("bad_format", "unknown export format 'onnx': choose peft, merged, gguf"),
    ("remote_code", "pass --trust_remote_code to export it merged"),
])
def test_user_errors_are_one_line(runs: dict, tmp_path: Path, case: str, message: str) -> None:
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text("model_name: tiny-opt\n")
    (tmp_path / "empty").mkdir()
    remote = tmp_path / "remote"  # a run folder from elsewhere whose config.yaml asks for remote code
    shutil.copytree(runs["xgb"], remote)
    text = (remote / "config.yaml").read_text()
    assert "trust_remote_code: false" in text
    (remote / "config.yaml").write_text(text.replace("trust_remote_code: false", "trust_remote_code: true"))
    args = {"missing": (tmp_path / "nope", "peft", None), "no_config": (tmp_path / "empty", "peft", None),
            "unfinished": (unfinished, "peft", None), "rank_merged": (runs["xgb"], "merged", 4),
            "rank_zero": (runs["xgb"], "peft", 0), "ft_peft": (runs["ft"], "peft", None),
            "bad_format": (runs["xgb"], "onnx", None), "remote_code": (remote, "merged", None)}[case]
    with pytest.raises(UserError, match=message) as info:
        export_run(args[0], args[1], tmp_path / "out", rank=args[2])
    assert "\n" not in str(info.value)


def test_cli_bad_run_dir_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    code = cli.main(["export", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "xgblora export: error:" in err
    assert not (tmp_path / "out").exists()


# the file whose opening for writing kills `xgblora export` part-way (after the weights are written)
EXPORT_KILLS = {"peft-svd": (["--format", "peft", "--rank", "1"], r"^adapter_config\.json$"),
                "merged": (["--format", "merged"], r"^tokenizer_config\.json$")}


@pytest.mark.parametrize("case", list(EXPORT_KILLS))
def test_export_killed_part_way_leaves_no_folder_and_a_rerun_writes_it_whole(runs: dict, tmp_path: Path,
                                                                            case: str) -> None:
    flags, pattern = EXPORT_KILLS[case]
    out, args = tmp_path / "out", ["export", str(runs["xgb"]), "--output_dir", str(tmp_path / "out"), *flags]
    assert run_dying_on_write(pattern, args, tmp_path / "stderr.txt") == KILLED
    assert not out.exists()  # a half-written export cannot pass for a finished one
    assert cli.main(args) == 0
    assert cli.main(["export", str(runs["xgb"]), "--output_dir", str(tmp_path / "whole"), *flags]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "whole").iterdir()) and EXPORT_RECORD in names
    for name in set(names) - {EXPORT_RECORD}:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "stderr.txt", "whole"]  # no .out.tmp left


def test_export_replaces_its_own_folder_whole_and_never_a_folder_of_other_files(runs: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_run(runs["xgb"], "peft", out, rank=1)
    export_run(runs["xgb"], "merged", out)  # an earlier export: replaced whole, no adapter files left over
    assert "adapter_config.json" not in {p.name for p in out.iterdir()}
    assert json.loads((out / EXPORT_RECORD).read_text())["format"] == "merged"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="holds files that xgblora export did not write"):
        export_run(runs["xgb"], "peft", mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


def test_the_clis_formats_and_their_flags_are_the_registrys(tmp_path: Path) -> None:
    """--format offers FORMATS' names and every format's options are flags of the command; an option of one format
    given to another, or a format without its output, is refused in one line before the run folder is read (it
    does not exist here)."""
    parser = cli.build_parser()._subparsers._group_actions[0].choices["export"]
    actions = {action.dest: action for action in parser._actions}
    assert actions["format"].choices == tuple(FORMATS)
    assert set(actions["quantization"].metavar.split("|")) == set(gguf_export.TYPES)
    values = {"output_dir": tmp_path / "d", "output_file": tmp_path / "f.gguf", "rank": 2, "quantization": "f16",
              "ollama_modelfile": tmp_path / "Modelfile"}
    every = {name for f in FORMATS.values() for name in (f.output, *f.options)}
    assert every == set(values) and every <= set(actions)
    for name, fmt in FORMATS.items():
        for other in sorted(every - {fmt.output, *fmt.options}):
            with pytest.raises(UserError, match=f"^--format {name}: --{other} does not apply$"):
                export_run(tmp_path / "nope", name, values[fmt.output], **{other: values[other]})
        with pytest.raises(UserError, match=f"^--format {name}: give --{fmt.output} {fmt.target}$"):
            export_run(tmp_path / "nope", name, None)
    assert list(tmp_path.iterdir()) == []
