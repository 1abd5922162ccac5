"""PEFT LoRA adapters, written and read: a run's boosters and current adapter as one adapter (concatenated, or
SVD-truncated to a rank), and any PEFT LoRA folder back as factors (safetensors only, no peft import)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from xgblora.adapters.lora import LoRALinear, is_adapter_param, lora_scaling
from xgblora.errors import UserError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

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


def svd_factors(terms: list[Term], rank: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
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


def write_peft(factors: dict[str, tuple[torch.Tensor, torch.Tensor, int, float]], out_dir: Path,
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
            A, B, kept, total = svd_factors(module_terms, rank)
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
    write_peft(factors, Path(out_dir), base_model_name_or_path, fan_in_fan_out, head=head, task_type=task_type)
    return {"rank": rank if rank is not None else max(f[2] for f in factors.values()), "modules": len(factors),
            "retained_energy": (kept_total / energy_total if energy_total > 0 else 1.0) if rank is not None else None,
            "retained_energy_per_module": energy if rank is not None else None}


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
        scaling = lora_scaling(alpha, r, bool(config.get("use_rslora")))
        out[name] = (A, B.float(), scaling)
    head = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and not is_adapter_param(k)}
    return out, head
