"""LoRA layers: a frozen base Linear plus a low-rank branch of fp32 factors (A, B); attach, merge, reset, a start from
the gradient, and member mode: K perturbed copies of the factors in one forward, each row of the batch on its
member's (MeZO's dual batch, K = 2; ES's members batched)."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xgblora.errors import UserError
from xgblora.models.quant import in_transformer_block, is_quantized

# Attention query and value projections, by model_type (the LoRA paper's choice and MeZO's).
_DEFAULT_TARGETS: dict[tuple[str, ...], list[str]] = {
    ("opt", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
     "gemma3_text", "phi", "olmo", "olmo2", "starcoder2", "gptj", "stablelm", "granite", "smollm3"): ["q_proj", "v_proj"],
    ("bert", "roberta", "xlm-roberta", "electra", "camembert", "ernie"): ["query", "value"],
    ("gpt2",): ["c_attn"],
    ("gpt_neox", "falcon", "bloom"): ["query_key_value"],
    ("phi3",): ["qkv_proj"],
    ("distilbert",): ["q_lin", "v_lin"],
}


def is_adapter_param(name: str) -> bool:
    """Whether a parameter (by qualified name) is an adapter factor: LoRALinear's lora_A or lora_B."""
    return ".lora_" in name or name.startswith("lora_")


def adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's adapter factors (every LoRALinear's lora_A and lora_B), by qualified name."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_param(n)]


def check_adapted(names: Iterable[str], adapted: Iterable[str]) -> None:
    """Refuse a trained adapter with a module that this run does not adapt (its factors would have no home)."""
    missing = sorted(set(names) - set(adapted))
    if missing:
        raise UserError(f"the adapter's module {missing[0]!r} is not among the adapted modules; leave "
                        f"--lora_target_modules unset (the adapter's modules) or include it")


def lora_delta(A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """The dense update of a low-rank branch, scale * B @ A, in fp32: the one formula every merge uses."""
    return scale * (B.float() @ A.float())


@torch.no_grad()
def add_delta_(weight: torch.Tensor, delta: torch.Tensor) -> None:
    """weight += delta, summed in fp32 and cast to the weight's dtype once (no double rounding in half precision)."""
    weight.copy_((weight.to(torch.float32) + delta).to(weight.dtype))


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear layer whose weight is stored (in, out), PEFT's fan_in_fan_out layout."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def lora_scaling(alpha: float, r: int, rslora: bool = False) -> float:
    """A LoRA branch's multiplier of B A: alpha / r (LoRA), or alpha / sqrt(r) (rsLoRA, Kalajdzievski 2023)."""
    return alpha / (math.sqrt(r) if rslora else r)


def features(base: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a linear layer: nn.Linear, GPT-2's Conv1D (weight (in, out)) or a 4-bit layer
    (whose weight is stored packed: its shape is not (out, in))."""
    return tuple(base.weight.shape[::-1]) if is_conv1d(base) else (base.out_features, base.in_features)


@dataclass
class MemberRows:
    """Which member's factors each row of the next forward runs on, shared by every layer in member mode: None, K
    equal runs of rows (member k: rows [k n, (k + 1) n)); else one member index per row, for a caller whose rows
    are regrouped between forwards (a sampler that plans batches by length and drops finished rows)."""

    index: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A frozen linear layer plus scaling * B A in fp32; inactive -> the base alone; member mode -> each row on its
    member's perturbed factors.

    The base is an nn.Linear (weight (out, in)), GPT-2's Conv1D (weight (in, out): `fan_in_fan_out`) or a 4-bit
    bitsandbytes Linear4bit; A and B have the same shapes for all, and a merge adds the delta in the base's own
    layout. A 4-bit weight cannot take a delta without re-quantising it (an NF4 rounding error per merge), so merges
    into it are kept exact, as low-rank fp32 factors beside it (`merged_A`, `merged_B`, the scale folded into B):
    XGBLoRA's T boosters of rank r cost T r (in + out) floats there, not a dense (out, in) matrix.
    """

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False):
        super().__init__()
        if r < 1:
            raise UserError(f"LoRA rank must be at least 1, got {r}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.fan_in_fan_out = is_conv1d(base)
        self.out_features, self.in_features = features(base)
        self.r, self.alpha = r, float(alpha)
        self.scaling = lora_scaling(self.alpha, r, rslora)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, dtype=torch.float32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, dtype=torch.float32, device=device))
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.active = True
        self._member_A: torch.Tensor | None = None  # member mode: [K, r, in], [K, out, r] and their rows
        self._member_B: torch.Tensor | None = None
        self._member_rows = MemberRows()
        self._weight_grad: torch.Tensor | None = None  # dL/dW being accumulated (start_weight_grad)
        self.register_buffer("merged_A", None, persistent=False)  # merges into a 4-bit base (see the class doc)
        self.register_buffer("merged_B", None, persistent=False)
        self.reset()

    def extra_repr(self) -> str:
        """r, alpha and whether the branch is on, for print(model)."""
        return f"r={self.r}, alpha={self.alpha:g}, active={self.active}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) + scaling * B A dropout(x), cast to the base output's dtype.

        Without a graph (MeZO's forwards, evaluation) the branch and the sum run in fp32, so that eps-sized
        perturbations of the fp32 factors reach the output unrounded. While autograd records (first-order
        training), the branch runs in the base output's dtype: autograd then keeps the input the base layer keeps
        anyway, not an fp32 copy of it per adapted layer (the factors and their gradients stay fp32).
        After start_weight_grad(), the backward through the output also adds dL/dW = grad_out^T x to it.
        """
        y = self._output(x)
        if self._weight_grad is not None and y.requires_grad:
            y.register_hook(functools.partial(self._add_weight_grad, x.detach()))
        return y

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if not self.active and self.merged_A is None:
            return out
        dtype = out.dtype if torch.is_grad_enabled() else torch.float32
        no_autocast = (torch.autocast(x.device.type, enabled=False) if torch.is_autocast_enabled(x.device.type)
                       else contextlib.nullcontext())
        with no_autocast:
            total = out.to(dtype)
            if self.merged_A is not None:
                total = total + F.linear(F.linear(x.to(dtype), self.merged_A.to(dtype)), self.merged_B.to(dtype))
            if self.active:
                total = total + self._branch(self.dropout(x).to(dtype))
            return total.to(out.dtype)

    def _branch(self, h: torch.Tensor) -> torch.Tensor:
        """scaling * B A h in h's dtype (each row on its member's factors in member mode)."""
        if self._member_A is not None:
            return self._members_delta(h)
        return F.linear(F.linear(h, self.lora_A.to(h.dtype)) * self.scaling, self.lora_B.to(h.dtype))

    def _members_delta(self, h: torch.Tensor) -> torch.Tensor:
        A, B = self._member_A.to(h.dtype), self._member_B.to(h.dtype)
        index = self._member_rows.index
        if index is None:  # K runs of rows: one batched product per member
            if h.shape[0] % len(A):
                raise ValueError(f"member mode with {len(A)} members needs a batch of K x n rows, got {h.shape[0]}")
            flat = h.reshape(len(A), -1, self.in_features)
        else:  # a member per row: each row's factors gathered (r x (in + out) floats a row)
            if len(index) != h.shape[0]:
                raise ValueError(f"member mode: {len(index)} rows' members for a batch of {h.shape[0]} rows")
            flat, A, B = h.reshape(h.shape[0], -1, self.in_features), A[index], B[index]
        mid = torch.bmm(flat, A.transpose(1, 2)) * self.scaling
        return torch.bmm(mid, B.transpose(1, 2)).reshape(*h.shape[:-1], self.out_features)

    def delta_weight(self) -> torch.Tensor:
        """The branch as a dense fp32 (out, in) matrix: scaling * B @ A."""
        return lora_delta(self.lora_A, self.lora_B, self.scaling)

    @torch.no_grad()
    def merge(self, shrinkage: float = 1.0) -> None:
        """Add shrinkage * the branch to the base (see merge_factors)."""
        self.merge_factors(self.lora_A, self.lora_B, shrinkage * self.scaling)

    @torch.no_grad()
    def merge_factors(self, A: torch.Tensor, B: torch.Tensor, scale: float) -> None:
        """base.weight += scale * B @ A (transposed for Conv1D), summed in fp32 and cast to its dtype once; for a
        4-bit base, (A, scale * B) join the fp32 side factors instead."""
        A, B = A.detach().to(self.lora_A), B.detach().to(self.lora_B)
        if is_quantized(self.base):
            self.merged_A = A.clone() if self.merged_A is None else torch.cat([self.merged_A, A])
            self.merged_B = scale * B if self.merged_B is None else torch.cat([self.merged_B, scale * B], dim=1)
            return
        delta = lora_delta(A, B, scale)
        add_delta_(self.base.weight, delta.T if self.fan_in_fan_out else delta)

    def clear_merged(self) -> None:
        """Drop the side factors of a 4-bit base (before they are rebuilt from a booster history)."""
        self.merged_A = self.merged_B = None

    @torch.no_grad()
    def load_factors(self, A: torch.Tensor, B: torch.Tensor, scaling: float) -> None:
        """Take a trained adapter's A (r, in), B (out, r) and scaling as this branch: the rank becomes r."""
        if A.shape[1] != self.in_features or B.shape[0] != self.out_features or A.shape[0] != B.shape[1]:
            raise UserError(f"adapter factors A {tuple(A.shape)}, B {tuple(B.shape)} do not fit a layer of "
                            f"{self.in_features} inputs and {self.out_features} outputs")
        device = self.lora_A.device
        self.lora_A = nn.Parameter(A.detach().to(device, torch.float32).clone())
        self.lora_B = nn.Parameter(B.detach().to(device, torch.float32).clone())
        self.r, self.scaling = A.shape[0], float(scaling)
        self.alpha = self.scaling * self.r

    @torch.no_grad()
    def reset(self, generator: torch.Generator | None = None) -> None:
        """A ~ Kaiming-uniform(a=sqrt(5)) as in PEFT and nn.Linear (drawn on the CPU, device-independent), B = 0."""
        bound = 1.0 / math.sqrt(self.in_features)  # gain sqrt(2 / (1 + 5)) * sqrt(3 / fan_in)
        fresh = torch.empty(self.lora_A.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        self.lora_A.copy_(fresh)
        self.lora_B.zero_()

    def start_weight_grad(self) -> None:
        """Accumulate the gradient of the layer's effective weight (base, merged boosters and branch: one (out, in)
        matrix W) over the backward passes that follow, in fp32, until take_weight_grad(). It costs one fp32
        matrix of the weight's size; the base weight itself stays frozen (a 4-bit one has no gradient)."""
        self._weight_grad = torch.zeros(self.out_features, self.in_features, dtype=torch.float32,
                                        device=self.lora_A.device)

    def take_weight_grad(self) -> torch.Tensor:
        """The gradient accumulated since start_weight_grad(), (out, in); accumulation stops."""
        grad, self._weight_grad = self._weight_grad, None
        return grad

    def _add_weight_grad(self, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        """dL/dW += grad_out^T x over every token of the batch (W's gradient for y = W x)."""
        self._weight_grad.addmm_(grad_out.reshape(-1, self.out_features).T.float(),
                                 x.reshape(-1, self.in_features).float())

    @torch.no_grad()
    def init_from_gradient(self, grad: torch.Tensor, taken: torch.Tensor | None = None) -> None:
        """Start the branch where grad (dL/dW, (out, in)) points: A = its r leading right singular vectors (rows of
        the norm reset() draws, 1/sqrt(3), so learning rates carry over), B = 0. With taken (orthonormal rows, (k,
        in)), the leading singular vectors of grad with those input directions projected off: the best rank-r step
        among directions no earlier booster took (kept only while at least r directions are left, and while grad
        has r directions outside taken above float32's rounding: else the plain start, as without taken).

        With B = 0 the output is unchanged, and the first gradient of B is scaling G A^T = scaling U_r S_r /
        sqrt(3): the first step moves B A along the leading singular directions of -G, the best rank-r descent
        step (Eckart-Young), where a random A takes a random projection of G. LoRA-GA (arXiv 2407.05000; PEFT's
        lora_ga_init) sets B != 0 too and subtracts the initial product from the base weight; here that would
        add a second rank-r term to every booster of an XGBLoRA history (and to every export) and a side factor
        per booster on a 4-bit base, where B = 0 already puts the first step on those directions.
        """
        grad = grad.float()
        _, s, vh = torch.linalg.svd(grad, full_matrices=False)
        if taken is not None and taken.shape[0] <= self.in_features - self.r:
            taken = taken.to(grad)
            _, s_off, vh_off = torch.linalg.svd(grad - (grad @ taken.T) @ taken, full_matrices=False)
            # inside the taken span the projection leaves rounding noise, whose directions are arbitrary
            if s_off[self.r - 1] > torch.finfo(grad.dtype).eps ** 0.5 * s[0]:
                vh = vh_off
        rows = vh[: self.r]
        signs = rows.gather(1, rows.abs().argmax(dim=1, keepdim=True)).sign()  # an SVD's signs are arbitrary
        self.lora_A.copy_(rows * signs / math.sqrt(3.0))
        self.lora_B.zero_()

    def set_members(self, A: torch.Tensor, B: torch.Tensor, rows: MemberRows | None = None) -> None:
        """Member mode: K members' factors A [K, r, in] and B [K, out, r]; `rows` says which rows run on which
        (default: K equal runs)."""
        if A.shape[1:] != self.lora_A.shape or B.shape[1:] != self.lora_B.shape or len(A) != len(B):
            raise ValueError(f"member factors {tuple(A.shape)}, {tuple(B.shape)} do not stack this layer's "
                             f"{tuple(self.lora_A.shape)}, {tuple(self.lora_B.shape)}")
        self._member_A, self._member_B = A, B
        self._member_rows = rows if rows is not None else MemberRows()

    def clear_members(self) -> None:
        """Leave member mode: the forward uses A and B again."""
        self._member_A = self._member_B = None
        self._member_rows = MemberRows()


@dataclass
class AttachReport:
    """What attach() did: the adapted modules by qualified name and the parameter counts."""

    modules: dict[str, LoRALinear]
    trainable_params: int
    total_params: int
    r: int = 8

    def __str__(self) -> str:
        suffixes = sorted({name.rsplit(".", 1)[-1] for name in self.modules})
        share = 100.0 * self.trainable_params / max(self.total_params, 1)
        return (f"LoRA r={self.r}: {len(self.modules)} modules ({', '.join(suffixes)}), "
                f"{self.trainable_params:,} trainable parameters ({share:.2f}% of {self.total_params:,})")


def default_targets(model: nn.Module) -> list[str]:
    """Attention query and value projection names for the model's architecture (config.model_type)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for types, targets in _DEFAULT_TARGETS.items():
        if model_type in types:
            return list(targets)
    raise UserError(f"no default LoRA target modules for model type {model_type!r}; pass --lora_target_modules "
                    f"(linear layers in this model: {', '.join(_linear_suffixes(model))})")


def _linear_suffixes(model: nn.Module, limit: int = 12) -> list[str]:
    names = dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m))
    return list(names)[:limit]


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


_REGEX_CHARS = set("*()[]|^$\\+?{}")


def target_matcher(spec: str | list[str] | None, model: nn.Module) -> Callable[[str], bool]:
    """Which module names to adapt, as PEFT reads target_modules: `all-linear` (every linear layer of the numbered
    transformer blocks, so never the LM head, a pooler or a new classifier head), a regular expression matched
    against the whole qualified name (a spec holding regex characters), or name suffixes (comma-separated or a
    list: exactly the name or its last dotted parts). None: the model family's attention query and value."""
    if isinstance(spec, str) and spec.strip() == "all-linear":
        return in_transformer_block
    if isinstance(spec, str) and _REGEX_CHARS & set(spec):
        try:
            pattern = re.compile(spec)
        except re.error as exc:
            raise UserError(f"LoRA target modules {spec!r}: not a valid regular expression ({exc})") from None
        return lambda name: pattern.fullmatch(name) is not None
    suffixes = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec or default_targets(model))]
    suffixes = [t for t in suffixes if t]
    return lambda name: any(name == t or name.endswith("." + t) for t in suffixes)


def attach(model: nn.Module, targets: str | list[str] | None = None, r: int = 8, alpha: float = 16.0,
           dropout: float = 0.0, rslora: bool = False) -> AttachReport:
    """Freeze the model and wrap every linear layer (nn.Linear or GPT-2's Conv1D) that `targets` selects
    (`target_matcher`) in a LoRALinear."""
    if lora_modules(model):
        raise UserError("the model already has LoRA adapters attached")
    selected = target_matcher(targets, model)
    matched = [(name, m) for name, m in model.named_modules() if name and _is_linear(m) and selected(name)]
    if not matched:
        raise UserError(f"LoRA target modules {targets or default_targets(model)}: no linear layer of the model "
                        f"matches (linear layers in this model: {', '.join(_linear_suffixes(model))})")
    name, narrowest = min(matched, key=lambda item: min(features(item[1])))
    if r > min(features(narrowest)):
        out_features, in_features = features(narrowest)
        raise UserError(f"--lora_r {r} is larger than the adapted layer {name} ({in_features} inputs, {out_features} "
                        f"outputs): B A has rank at most {min(out_features, in_features)} there; pass --lora_r "
                        f"{min(out_features, in_features)} or less")
    for p in model.parameters():
        p.requires_grad_(False)
    modules: dict[str, LoRALinear] = {}
    for name, module in matched:
        parent_name, _, child = name.rpartition(".")
        modules[name] = LoRALinear(module, r, alpha, dropout, rslora)
        setattr(model.get_submodule(parent_name), child, modules[name])
    trainable = sum(p.numel() for m in modules.values() for p in (m.lora_A, m.lora_B))
    total = sum(p.numel() for p in model.parameters())
    return AttachReport(modules, trainable, total, r)


def attach_factors(model: nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                   dropout: float = 0.0) -> AttachReport:
    """Attach LoRALinear layers to exactly the modules of a trained adapter ({name: (A, B, scaling)}), each with the
    adapter's own rank, factors and scaling."""
    missing = [name for name in factors if not _is_linear(_submodule(model, name))]
    if missing:
        raise UserError(f"the adapter's module {missing[0]!r} is not a linear layer of this model "
                        f"(is the adapter for another base model?)")
    first_rank = next(iter(factors.values()))[0].shape[0]
    report = attach(model, exact_targets(factors), r=first_rank, dropout=dropout)
    for name, (A, B, scaling) in factors.items():
        report.modules[name].load_factors(A, B, scaling)
    report.trainable_params = sum(p.numel() for m in report.modules.values() for p in (m.lora_A, m.lora_B))
    return report


def exact_targets(names: Iterable[str]) -> str:
    """A target spec (a regular expression) that selects exactly these qualified module names."""
    return "|".join(re.escape(name) for name in names)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRALinear in the model, by qualified module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def unwrap(model: nn.Module) -> None:
    """Merge every active adapter into its base Linear and put the plain Linear back in its place."""
    for name, module in lora_modules(model).items():
        if is_quantized(module.base):
            raise UserError(f"{name}: a 4-bit base weight cannot take a merged adapter; keep the adapter attached "
                            f"(or load the base in 16/32 bits to merge)")
        if module.active:
            module.merge(1.0)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module.base)


def prepare_full_ft(model: nn.Module) -> int:
    """Make every parameter trainable (full fine-tuning); return how many parameters that is."""
    for p in model.parameters():
        p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def adapters_off(modules: Mapping[str, LoRALinear]) -> Iterator[None]:
    """The model without its adapter branches (the reference policy of an adapter run); restored on exit."""
    was = {name: m.active for name, m in modules.items()}
    try:
        for m in modules.values():
            m.active = False
        yield
    finally:
        for name, m in modules.items():
            m.active = was[name]


def adapter_snapshot(modules: Mapping[str, LoRALinear]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A frozen copy of every adapter branch's factors (A, B): the reference policy of a continued adapter."""
    return {name: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for name, m in modules.items()}


@contextlib.contextmanager
def adapter_factors(modules: Mapping[str, LoRALinear], factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """The model with its adapter branches' factors replaced by `factors` (adapter_snapshot's); restored on exit.
    Only for passes without a graph: the parameters' storage is swapped, not the parameters."""
    kept = {name: (m.lora_A.data, m.lora_B.data) for name, m in modules.items()}
    try:
        for name, (A, B) in factors.items():
            modules[name].lora_A.data, modules[name].lora_B.data = A, B
        yield
    finally:
        for name, (A, B) in kept.items():
            modules[name].lora_A.data, modules[name].lora_B.data = A, B
