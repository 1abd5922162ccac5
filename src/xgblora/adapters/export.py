"""Export trained adapters: a PEFT LoRA adapter (boosters concatenated, or SVD-truncated) or a merged model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from xgblora.adapters.lora import LoRALinear, unwrap
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


def to_peft(modules: dict[str, LoRALinear], history: list[dict[str, Any]], out_dir: Path,
            base_model_name_or_path: str, rank: int | None = None, include_current: bool = True) -> dict[str, Any]:
    """Write a PEFT LoRA adapter equal to all boosters (+ the current adapter) applied to the ORIGINAL base weights."""
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
        elif name in current_only:  # plain LoRA: the adapter as trained, rank r and alpha
            A, B, _ = module_terms[0]
            factors[name] = (A, B, modules[name].r, modules[name].alpha)
        else:  # boosters side by side: rank T, alpha = T so that PEFT's scaling is 1
            A = torch.cat([A for A, _, _ in module_terms])
            B = torch.cat([s * B for _, B, s in module_terms], dim=1)
            factors[name] = (A, B, A.shape[0], float(A.shape[0]))

    (r, alpha), _ = Counter((f[2], f[3]) for f in factors.values()).most_common(1)[0]
    differ = [name for name, f in factors.items() if (f[2], f[3]) != (r, alpha)]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(factors), "rank_pattern": {name: factors[name][2] for name in differ},
        "alpha_pattern": {name: factors[name][3] for name in differ}, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
    }
    tensors = {}
    for name, (A, B, _, _) in factors.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = A.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = B.contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
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
