"""Export trained adapters: a PEFT LoRA adapter (boosters concatenated, or SVD-truncated) or a merged model."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from xgblora import atomic
from xgblora.adapters.lora import LoRALinear, is_adapter_param, unwrap
from xgblora.errors import UserError

# One low-rank term of a module's total update: scale * B @ A.
Term = tuple[torch.Tensor, torch.Tensor, float]


def _terms(modules: dict[str, LoRALinear], history: list[dict[str, Any]],
           include_current: bool) -> tuple[dict[str, list[Term]], set[str]]:
    """Each module's boosters (and current adapter); and the modules whose only term is their current adapter."""
    terms: dict[str, list[Term]] = {name: [] for name in modules}
    for booster in history:
        for name, rec in booster["modules"].items():
            if name not in terms:
                raise UserError(f"booster {booster['booster']} holds module {name!r}, which is not an adapted module")
            terms[name].append((rec["A"], rec["B"], float(rec["scale"])))
    current_only = set()
    for name, m in modules.items():
        A, B = m.lora_A.detach().float().cpu(), m.lora_B.detach().float().cpu()
        nonzero = bool(A.any()) and bool(B.any())
        if include_current and m.active and nonzero:
            if not terms[name]:
                current_only.add(name)
            terms[name].append((A, B, m.scaling))
    if not any(terms.values()):  # nothing trained yet: the current (zero-effect) adapters, so the export still loads
        terms, current_only = {name: [(m.lora_A.detach().float().cpu(), m.lora_B.detach().float().cpu(), m.scaling)]
                               for name, m in modules.items()}, set(modules)
    return {name: t for name, t in terms.items() if t}, current_only


def _svd_factors(terms: list[Term], rank: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Rank-`rank` factors (A, B) of sum_k scale_k B_k A_k, with the kept and total squared singular values."""
    A_cat = torch.cat([A.double() for A, _, _ in terms])
    B_cat = torch.cat([s * B.double() for _, B, s in terms], dim=1)
    q_b, r_b = torch.linalg.qr(B_cat)  # delta = q_b (r_b r_a^T) q_a^T: the SVD of a small core matrix
    q_a, r_a = torch.linalg.qr(A_cat.T)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)
    keep = min(rank, s.numel())
    root = s[:keep].sqrt()
    B = torch.zeros(B_cat.shape[0], rank, dtype=torch.float64)
    A = torch.zeros(rank, A_cat.shape[1], dtype=torch.float64)
    B[:, :keep] = (q_b @ u[:, :keep]) * root
    A[:keep] = root[:, None] * (q_a @ vh[:keep].T).T
    return A.float(), B.float(), float(s[:keep].square().sum()), float(s.square().sum())


def _write_peft(factors: dict[str, tuple[torch.Tensor, torch.Tensor, int, float]], out_dir: Path,
                base_model_name_or_path: str, fan_in_fan_out: bool = False,
                head: dict[str, torch.Tensor] | None = None, task_type: str | None = None) -> None:
    """Write {module: (A, B, r, alpha)} as a PEFT LoRA adapter (the most common r/alpha, the rest as patterns).

    `head` ({parameter name: tensor}, a trained classification head) is saved whole as PEFT's modules_to_save of
    a SEQ_CLS adapter.
    """
    (r, alpha), _ = Counter((f[2], f[3]) for f in factors.values()).most_common(1)[0]
    differ = [name for name, f in factors.items() if (f[2], f[3]) != (r, alpha)]
    config = {
        "peft_type": "LORA", "task_type": task_type or ("SEQ_CLS" if head else "CAUSAL_LM"),
        "base_model_name_or_path": base_model_name_or_path,
        "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": fan_in_fan_out,
        "target_modules": sorted(factors), "rank_pattern": {name: factors[name][2] for name in differ},
        "alpha_pattern": {name: factors[name][3] for name in differ}, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": sorted({name.split(".")[0] for name in head}) if head else None,
    }
    tensors = {}
    for name, (A, B, _, _) in factors.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = A.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = B.contiguous()
    for name, tensor in (head or {}).items():
        tensors[f"base_model.model.{name}"] = tensor.detach().float().cpu().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def to_peft(modules: dict[str, LoRALinear], history: list[dict[str, Any]], out_dir: Path,
            base_model_name_or_path: str, rank: int | None = None, include_current: bool = True,
            head: dict[str, torch.Tensor] | None = None, task_type: str | None = None) -> dict[str, Any]:
    """Write a PEFT LoRA adapter equal to all boosters (+ the current adapter) applied to the ORIGINAL base weights.

    `head`: a trained classification head's parameters, saved as the adapter's modules_to_save; `task_type`: PEFT's
    (default CAUSAL_LM, or SEQ_CLS with a head; FEATURE_EXTRACTION for an encoder's embedding model).
    """
    if rank is not None and rank < 1:
        raise UserError(f"export rank must be at least 1, got {rank}")
    terms, current_only = _terms(modules, history, include_current)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, int, float]] = {}
    energy: dict[str, float] = {}
    kept_total, energy_total = 0.0, 0.0
    for name, module_terms in terms.items():
        if rank is not None:
            A, B, kept, total = _svd_factors(module_terms, rank)
            energy[name] = kept / total if total > 0 else 1.0
            kept_total, energy_total = kept_total + kept, energy_total + total
            factors[name] = (A, B, rank, float(rank))
        elif name in current_only:  # plain LoRA: the adapter as trained, rank r, alpha giving its scaling (rsLoRA too)
            A, B, _ = module_terms[0]
            factors[name] = (A, B, modules[name].r, modules[name].scaling * modules[name].r)
        else:  # boosters side by side: rank T, alpha = T so that PEFT's scaling is 1
            A = torch.cat([A for A, _, _ in module_terms])
            B = torch.cat([s * B for _, B, s in module_terms], dim=1)
            factors[name] = (A, B, A.shape[0], float(A.shape[0]))

    fan_in_fan_out = any(m.fan_in_fan_out for m in modules.values())  # GPT-2's Conv1D layers
    _write_peft(factors, Path(out_dir), base_model_name_or_path, fan_in_fan_out, head=head, task_type=task_type)
    return {"rank": rank if rank is not None else max(f[2] for f in factors.values()), "modules": len(factors),
            "retained_energy": (kept_total / energy_total if energy_total > 0 else 1.0) if rank is not None else None,
            "retained_energy_per_module": energy if rank is not None else None}


def merged(model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
    """Merge every adapter into its base weights (unwrap, in place), then save model and tokenizer (safetensors)."""
    unwrap(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


_ST_POOLING = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def write_sentence_transformers(out: Path, pooling: str, dim: int, max_length: int, query_prefix: str = "",
                                doc_prefix: str = "") -> None:
    """Make a saved model folder a sentence-transformers model with the pooling it was trained with: Transformer
    (the folder itself) -> Pooling -> Normalize; the instruction prefixes become its prompts "query"/"document"."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    pooling_config = {"word_embedding_dimension": dim, "pooling_mode_max_tokens": False,
                      "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                      **{key: mode == pooling for mode, key in _ST_POOLING.items()}}
    prompts = {name: text for name, text in (("query", query_prefix), ("document", doc_prefix)) if text}
    files = {"modules.json": modules, "1_Pooling/config.json": pooling_config,
             "sentence_bert_config.json": {"max_seq_length": max_length, "do_lower_case": False},
             "config_sentence_transformers.json": {"prompts": prompts, "default_prompt_name": None,
                                                   "similarity_fn_name": "cosine"}}
    (out / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    for name, value in files.items():
        (out / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def embedding_export(out: Path, cfg: dict[str, Any], dim: int) -> None:
    """The sentence-transformers files of an embedding run's (config.yaml as a dict) saved model."""
    write_sentence_transformers(out, cfg["pooling"], dim, int(cfg["max_length"]), cfg.get("query_instruction") or "",
                                cfg.get("doc_instruction") or "")


# ----------------------------------------------------------------------------- `xgblora export`

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
EXPORT_RECORD = "xgblora_export.json"  # what was exported from where; marks a folder an export may replace


def _pattern_value(pattern: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: an exact module name, else a key matching a name suffix."""
    if name in pattern:
        return pattern[name]
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?{key}$", name):
            return value
    return default


def read_adapter(folder: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, float]], dict[str, torch.Tensor]]:
    """{module: (A, B, scaling)} of a PEFT LoRA adapter folder, and its modules_to_save tensors (a classification
    head) by parameter name; read with safetensors (no peft import)."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise UserError(f"{folder}: cannot read the PEFT adapter ({exc.__class__.__name__}: {exc})") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise UserError(f"{folder}: only plain LoRA adapters can be exported (peft_type "
                        f"{config.get('peft_type')!r}, use_dora {config.get('use_dora')})")
    prefix, suffix_a, suffix_b = "base_model.model.", ".lora_A.weight", ".lora_B.weight"
    names = sorted(k[len(prefix):-len(suffix_a)] for k in tensors if k.startswith(prefix) and k.endswith(suffix_a))
    if not names:
        raise UserError(f"{folder}: the adapter holds no LoRA weights")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    out = {}
    for name in names:
        B = tensors.get(prefix + name + suffix_b)
        if B is None:
            raise UserError(f"{folder}: module {name!r} has lora_A but no lora_B")
        A = tensors[prefix + name + suffix_a].float()
        r = int(_pattern_value(rank_pattern, name, config.get("r", A.shape[0])))
        alpha = float(_pattern_value(alpha_pattern, name, config.get("lora_alpha", r)))
        scaling = alpha / (r ** 0.5 if config.get("use_rslora") else r)
        out[name] = (A, B.float(), scaling)
    head = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and not is_adapter_param(k)}
    return out, head


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as a dict; UserError when it is missing or names no model."""
    cfg_path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    if not cfg_path.is_file():
        raise UserError(f"{run_dir}: not a run folder (no config.yaml)")
    try:
        cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{cfg_path}: cannot read ({exc.__class__.__name__})") from None
    if not isinstance(cfg, dict) or not cfg.get("model_name"):
        raise UserError(f"{cfg_path}: no model_name")
    return cfg


def _source_folder(run_dir: Path, checkpoint: str | None) -> Path:
    """What an export reads: final/ (a PEFT adapter, or full fine-tuning's whole model), or a checkpoint's adapter."""
    if checkpoint is not None:
        from xgblora.train import checkpoint as ckpt  # the checkpoint layout is train/checkpoint.py's alone

        return ckpt.adapter_folder(ckpt.find(run_dir / "checkpoints", checkpoint))
    final = run_dir / "final"
    if not ((final / "adapter_config.json").is_file() or (final / "config.json").is_file()):
        raise UserError(f"{run_dir}: the run is not finished (no final/ adapter or model); train it to the end, or "
                        f"export a checkpoint with --checkpoint latest|best|step-N")
    return final


def _check_out(out: Path, run_dir: Path) -> None:
    """Refuse to write into the run's own final/ folder, over a file, or over a folder of someone else's files
    (an export replaces its folder whole)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_RECORD).is_file():
        raise UserError(f"--out {out}: the folder holds files that xgblora export did not write; choose a new or "
                        f"empty folder (an export replaces its folder whole)")
    if out.resolve() == (run_dir / "final").resolve() or out.resolve() == run_dir.resolve():
        raise UserError(f"--out {out}: choose a folder other than the run's own")


def _energy_report(energy: dict[str, float], kept: float, total: float) -> dict[str, Any]:
    """Overall and per-module retained energy (fraction of squared singular values kept)."""
    worst = min(energy, key=energy.get)
    return {"retained_energy": kept / total if total > 0 else 1.0, "retained_energy_min": energy[worst],
            "retained_energy_min_module": worst}


def export_run(run_dir: Path, fmt: str, out: Path, rank: int | None = None, trust_remote_code: bool = False,
               checkpoint: str | None = None) -> dict[str, Any]:
    """Export a finished run's final/, or any of its checkpoints (`checkpoint`: step-N, latest, best; a run that
    was interrupted too), as a PEFT adapter (optionally SVD-compressed to `rank`) or a merged model.

    A merged export loads the base model; its own code runs only with trust_remote_code (the run's config.yaml
    saying so is not enough: a run folder can come from anyone).
    """
    run_dir, out = Path(run_dir), Path(out)
    if fmt not in ("peft", "merged"):
        raise UserError(f"unknown export format {fmt!r}: choose peft or merged")
    if rank is not None and fmt == "merged":
        raise UserError("--rank applies to --format peft only (a merged model has no adapter rank)")
    if rank is not None and rank < 1:
        raise UserError(f"--rank must be at least 1, got {rank}")
    cfg = run_config(run_dir)
    final = _source_folder(run_dir, checkpoint)
    _check_out(out, run_dir)
    with atomic.replaced_folder(out) as folder:  # a folder at `out` is a whole export; a kill leaves .out.tmp
        result = {"format": fmt, "out": str(out), "base_model": cfg["model_name"], "source": str(final),
                  **_export_into(folder, cfg, final, run_dir, fmt, rank, trust_remote_code)}
        (folder / EXPORT_RECORD).write_text(json.dumps({**result, "run_dir": str(run_dir)}, indent=2) + "\n",
                                            encoding="utf-8")
    return result


def _export_into(out: Path, cfg: dict[str, Any], final: Path, run_dir: Path, fmt: str, rank: int | None,
                 trust_remote_code: bool) -> dict[str, Any]:
    """Write the export into the (temporary) folder `out`; return what it holds (modules, rank, energy)."""
    is_adapter = (final / "adapter_config.json").is_file()
    result: dict[str, Any] = {"modules": 0, "rank": None, "retained_energy": None}
    if not is_adapter:  # full fine-tuning: final/ is the whole model
        if fmt == "peft":
            raise UserError(f"{run_dir} is a full fine-tuning run (method ft): it has no adapter to export as "
                            f"PEFT; use --format merged")
        shutil.copytree(final, out, dirs_exist_ok=True)  # `out` is the empty temporary folder
        return result
    adapter, head = read_adapter(final)
    result["modules"] = len(adapter)
    if fmt == "peft":  # the run's tokenizer and chat template travel with the adapter
        _copy_tokenizer(final, out)
    if fmt == "peft" and rank is None:
        for name in _ADAPTER_FILES:
            shutil.copy2(final / name, out / name)
        result["rank"] = max(A.shape[0] for A, _, _ in adapter.values())
        return result
    if fmt == "peft":
        factors: dict[str, tuple[torch.Tensor, torch.Tensor, int, float]] = {}
        energy: dict[str, float] = {}
        kept_total, energy_total = 0.0, 0.0
        for name, term in adapter.items():
            A, B, kept, total = _svd_factors([term], rank)
            factors[name] = (A, B, rank, float(rank))
            energy[name] = kept / total if total > 0 else 1.0
            kept_total, energy_total = kept_total + kept, energy_total + total
        fan_in_fan_out = bool(json.loads((final / "adapter_config.json").read_text()).get("fan_in_fan_out"))
        _write_peft(factors, out, cfg["model_name"], fan_in_fan_out, head=head)
        return {**result, "rank": rank, **_energy_report(energy, kept_total, energy_total)}
    if cfg.get("trust_remote_code") and not trust_remote_code:
        raise UserError(f"{run_dir} was trained with --trust_remote_code; pass --trust_remote_code to export it "
                        f"merged (the base model runs its own code)")
    return {**result, **_merge_into_base(cfg, final, out, trust_remote_code)}


def _copy_tokenizer(final: Path, out: Path) -> None:
    """The tokenizer files beside an adapter (everything in final/ but the adapter itself and its model card)."""
    for path in final.iterdir():
        if path.is_file() and path.name not in (*_ADAPTER_FILES, "README.md"):
            shutil.copy2(path, out / path.name)


def _run_head(cfg: dict[str, Any], model_name: str, trust_remote_code: bool) -> str:
    """The model class a run's model loads as: its embedding class for an embedding objective, else its --head."""
    from xgblora import models

    if cfg.get("objective", "lm") != "lm":
        return models.embedding_head(model_name, cfg["objective"], trust_remote_code)
    return cfg.get("head", "auto")


def _merge_into_base(cfg: dict[str, Any], adapter: Path, out: Path, trust_remote_code: bool) -> dict[str, Any]:
    """Load the base model in the run's dtype with the adapter merged (fp32 sums, cast once) and its trained
    classification head, the base always in 16/32 bits (a 4-bit run's adapter merges into the unquantised base);
    save model and tokenizer, an embedding run's as a sentence-transformers model too."""
    from xgblora import loading  # the one model loader, which reads adapters with this module

    dtype = "float16" if cfg.get("load_float16") else "bfloat16" if cfg.get("load_bfloat16") else "float32"
    head = _run_head(cfg, cfg["model_name"], trust_remote_code)
    model, tokenizer = loading.load_model(loading.ModelSource(cfg["model_name"], adapter), dtype=dtype,
                                          trust_remote_code=trust_remote_code, head=head)
    model.config.use_cache = True  # models.load turns it off for training; a merged export is for inference
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    embedding = cfg.get("objective", "lm") != "lm"
    if embedding:  # embeddings read right-padded inputs (a causal LM's positions count from the left)
        tokenizer.padding_side = "right"
        embedding_export(out, cfg, model.config.hidden_size)
    tokenizer.save_pretrained(out)
    return {"dtype": dtype, **({"sentence_transformers": True} if embedding else {})}


def load_run_model(run_dir: Path, trust_remote_code: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """A finished run's trained model in memory (its adapter merged into the base, or its full final/ model), its
    tokenizer, and its config.yaml as a dict."""
    from xgblora import loading

    cfg = run_config(Path(run_dir))
    if cfg.get("trust_remote_code") and not trust_remote_code:
        raise UserError(f"{run_dir} was trained with --trust_remote_code; pass --trust_remote_code to load it")
    source = loading.resolve(str(run_dir))
    model, tokenizer = loading.load_model(source, trust_remote_code=trust_remote_code,
                                          head=_run_head(cfg, source.base, trust_remote_code))
    return model, tokenizer, cfg
