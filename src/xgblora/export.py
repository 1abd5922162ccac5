"""`xgblora export`: a finished run's final/ or any of its checkpoints as a PEFT adapter (as trained, or
SVD-compressed to a rank), as a merged model (an embedding run's also as a sentence-transformers model, a reranker's
as a CrossEncoder), or as one
GGUF file for llama.cpp and Ollama (the merged model converted by models/gguf_export.py).

`FORMATS` holds each format's writer and the options it reads; `export_run` checks a request against it, so that
adding a format is its writer and its entry."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from xgblora import atomic
from xgblora.adapters import trained
from xgblora.adapters.peft import ADAPTER_FILES, read_adapter, svd_factors, write_peft
from xgblora.checkpoint import adapter_folder, find, run_config
from xgblora.embeddings.st_format import embedding_export, write_cross_encoder
from xgblora.errors import UserError
from xgblora.models import gguf_export, modelfile, pretrained

EXPORT_RECORD = "xgblora_export.json"  # what was exported from where; marks a folder an export may replace


@dataclass(frozen=True)
class Source:
    """What an export reads: the run folder, its config.yaml, the folder exported (final/, or a checkpoint's
    adapter) and whether the base model may run its own code."""

    run_dir: Path
    cfg: dict[str, Any]
    folder: Path
    trust_remote_code: bool

    @property
    def is_adapter(self) -> bool:
        """A PEFT adapter; else full fine-tuning's whole model."""
        return (self.folder / "adapter_config.json").is_file()


@dataclass(frozen=True)
class Format:
    """An `xgblora export --format`: the option naming what it writes (`output`, `target` the kind of path it
    wants), the options of its own it reads, and its writer, write(source, out, **those options)."""

    output: str
    target: str
    options: tuple[str, ...]
    write: Callable[..., dict[str, Any]]


def export_run(run_dir: Path, fmt: str, out: Path | None, checkpoint: str | None = None,
               trust_remote_code: bool = False, **options: Any) -> dict[str, Any]:
    """Export a finished run's final/, or any of its checkpoints (`checkpoint`: step-N, latest, best; a run that
    was interrupted too), in the format FORMATS[fmt] to `out`. options: format options by name, None where not
    given; one given that the format does not read is refused, as is a missing `out`.

    A merged or GGUF export loads the base model; its own code runs only with trust_remote_code (the run's
    config.yaml saying so is not enough: a run folder can come from anyone).
    """
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}: choose {', '.join(FORMATS)}")
    chosen, given = FORMATS[fmt], {name: value for name, value in options.items() if value is not None}
    wrong = [f"--{name}" for name in given if name not in chosen.options]
    if wrong or out is None:
        raise UserError(f"--format {fmt}: " + (f"{', '.join(wrong)} does not apply" if wrong else
                                               f"give --{chosen.output} {chosen.target}"))
    run_dir = Path(run_dir)
    source = Source(run_dir, run_config(run_dir), _source_folder(run_dir, checkpoint), trust_remote_code)
    return chosen.write(source, Path(out), **given)


def _source_folder(run_dir: Path, checkpoint: str | None) -> Path:
    """What an export reads: final/ (a PEFT adapter, or full fine-tuning's whole model), or a checkpoint's adapter."""
    if checkpoint is not None:
        return adapter_folder(find(run_dir / "checkpoints", checkpoint))
    final = run_dir / "final"
    if not ((final / "adapter_config.json").is_file() or (final / "config.json").is_file()):
        raise UserError(f"{run_dir}: the run is not finished (no final/ adapter or model); train it to the end, or "
                        f"export a checkpoint with --checkpoint latest|best|step-N")
    return final


def _check_out(out: Path, run_dir: Path) -> None:
    """Refuse to write into the run's own final/ folder, over a file, or over a folder of someone else's files
    (an export replaces its folder whole)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_RECORD).is_file():
        raise UserError(f"--output_dir {out}: the folder holds files that xgblora export did not write; choose a new or "
                        f"empty folder (an export replaces its folder whole)")
    if out.resolve() == (run_dir / "final").resolve() or out.resolve() == run_dir.resolve():
        raise UserError(f"--output_dir {out}: choose a folder other than the run's own")


def _energy_report(energy: dict[str, float], kept: float, total: float) -> dict[str, Any]:
    """Overall and per-module retained energy (fraction of squared singular values kept)."""
    worst = min(energy, key=energy.get)
    return {"retained_energy": kept / total if total > 0 else 1.0, "retained_energy_min": energy[worst],
            "retained_energy_min_module": worst}


def _export_folder(source: Source, out: Path, fmt: str,
                   fill: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Write a folder export: `fill` writes into the (temporary) folder and returns what it holds; the folder
    replaces `out` whole when done (a kill leaves .out.tmp), with a record of what was exported from where."""
    _check_out(out, source.run_dir)
    atomic.check_writable(out, "--output_dir")  # before the model loads: the export is written beside `out`
    with _refused_writes(out), atomic.replaced_folder(out) as folder:
        result = {"format": fmt, "out": str(out), "base_model": source.cfg["model_name"],
                  "source": str(source.folder), "modules": 0, "rank": None, "retained_energy": None, **fill(folder)}
        record = {**result, "run_dir": str(source.run_dir)}
        (folder / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return result


def _refused_writes(target: Path,
                    needed: Callable[[], int] | None = None) -> contextlib.AbstractContextManager[None]:
    """A write the disk refuses in the block (full, over quota, an I/O error) ends in the one line that names the
    export and, where `needed` tells, the space it needs; any other error goes on as it was. The export's
    temporary files are removed as the error leaves their block: nothing is left under the export's name."""
    return atomic.write_errors(target, "Nothing was written under that name: free some space and export again",
                               needed, what="export", errors=(OSError, SafetensorError), disk_only=True)


def _write_peft(source: Source, out: Path, rank: int | None = None) -> dict[str, Any]:
    """The run's adapter as a PEFT LoRA adapter folder, with the run's tokenizer and chat template: as trained, or
    each module's summed delta compressed to `rank` by truncated SVD (with the energy it retains)."""
    if rank is not None and rank < 1:
        raise UserError(f"--rank must be at least 1, got {rank}")
    if not source.is_adapter:
        raise UserError(f"{source.run_dir} is a full fine-tuning run (method ft): it has no adapter to export as "
                        f"PEFT; use --format merged")
    return _export_folder(source, out, "peft", lambda folder: _peft_into(folder, source, rank))


def _peft_into(out: Path, source: Source, rank: int | None) -> dict[str, Any]:
    """Write the PEFT adapter into the (temporary) folder `out`; return its modules, rank and retained energy."""
    final = source.folder
    adapter, head = read_adapter(final)
    _copy_tokenizer(final, out)
    if rank is None:
        for name in ADAPTER_FILES:
            shutil.copy2(final / name, out / name)
        return {"modules": len(adapter), "rank": max(A.shape[0] for A, _, _ in adapter.values())}
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, int, float]] = {}
    energy: dict[str, float] = {}
    kept_total, energy_total = 0.0, 0.0
    for name, term in adapter.items():
        A, B, kept, total = svd_factors([term], rank)
        factors[name] = (A, B, rank, float(rank))
        energy[name] = kept / total if total > 0 else 1.0
        kept_total, energy_total = kept_total + kept, energy_total + total
    fan_in_fan_out = bool(json.loads((final / "adapter_config.json").read_text()).get("fan_in_fan_out"))
    write_peft(factors, out, source.cfg["model_name"], fan_in_fan_out, head=head)
    return {"modules": len(adapter), "rank": rank, **_energy_report(energy, kept_total, energy_total)}


def _write_merged(source: Source, out: Path) -> dict[str, Any]:
    """The full model with every delta merged (an embedding run's also as a sentence-transformers model)."""
    _check_remote_code(source)
    return _export_folder(source, out, "merged", lambda folder: _merged_into(folder, source, out))


def _check_remote_code(source: Source) -> None:
    """Refuse to merge into a base model that runs its own code unless the user, not the run folder, allows it."""
    if source.is_adapter and source.cfg.get("trust_remote_code") and not source.trust_remote_code:
        raise UserError(f"{source.run_dir} was trained with --trust_remote_code; pass --trust_remote_code to "
                        f"export it merged (the base model runs its own code)")


def _merged_into(out: Path, source: Source, target: Path) -> dict[str, Any]:
    """Write the merged model into the (temporary) folder `out`: full fine-tuning's final/ as it is, else the base
    with the adapter merged; return what it holds. `target`: the export's own name, for an error."""
    if not source.is_adapter:
        shutil.copytree(source.folder, out, dirs_exist_ok=True)  # `out` is the empty temporary folder
        return {}
    return {"modules": len(read_adapter(source.folder)[0]), **_merge_into_base(source, out, target)}


def _copy_tokenizer(final: Path, out: Path) -> None:
    """The tokenizer files beside an adapter (everything in final/ but the adapter itself and its model card)."""
    for path in final.iterdir():
        if path.is_file() and path.name not in (*ADAPTER_FILES, "README.md"):
            shutil.copy2(path, out / path.name)


def _merge_into_base(source: Source, out: Path, target: Path) -> dict[str, Any]:
    """Load the base model in the run's dtype with the adapter merged (fp32 sums, cast once) and its trained
    classification head, the base always in 16/32 bits (a 4-bit run's adapter merges into the unquantised base);
    save model and tokenizer, an embedding run's as a sentence-transformers model too."""
    cfg, trust_remote_code = source.cfg, source.trust_remote_code
    dtype = "float16" if cfg.get("load_float16") else "bfloat16" if cfg.get("load_bfloat16") else "float32"
    head = trained.run_head(cfg, cfg["model_name"], trust_remote_code)
    model, tokenizer = trained.load_model(trained.ModelSource(cfg["model_name"], source.folder), dtype=dtype,
                                          trust_remote_code=trust_remote_code, head=head)
    model.config.use_cache = True  # pretrained.load turns it off for training; a merged export is for inference
    embedding, reranker = cfg.get("objective", "lm") in ("contrastive", "grit"), cfg.get("objective") == "rerank"
    with _refused_writes(target, lambda: _nbytes(model)):  # here the model is known: the space the export needs
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        if embedding:  # embeddings read right-padded inputs (a causal LM's positions count from the left)
            tokenizer.padding_side = "right"
            embedding_export(out, cfg, model.config.hidden_size)
        tokenizer.save_pretrained(out)
        if reranker:
            write_cross_encoder(out, int(cfg["max_length"]))
    return {"dtype": dtype, **({"sentence_transformers": True} if embedding or reranker else {})}


def _nbytes(model: torch.nn.Module) -> int:
    """The bytes of a model's weights as saved (tied weights once)."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.nelement() * t.element_size() for t in tensors.values())


def _write_gguf(source: Source, out: Path, quantization: str | None = None,
                ollama_modelfile: str | Path | None = None) -> dict[str, Any]:
    """The run merged, as the GGUF file `out` at `quantization` (default: the type of the GGUF file the run was
    trained from, else f16), re-read before it is published; with an Ollama Modelfile beside it when asked.
    Neither file is ever written over an existing one."""
    ollama = Path(ollama_modelfile) if ollama_modelfile is not None else None
    for flag, path in (("--output_file", out), ("--ollama_modelfile", ollama)):
        if path is not None and path.exists():
            raise UserError(f"{flag} {path}: exists; choose a new file name (an export never overwrites a file)")
    if quantization is not None and quantization not in gguf_export.TYPES:
        raise UserError(f"--quantization {quantization}: choose one of {', '.join(gguf_export.TYPES)}")
    _check_remote_code(source)
    _check_gguf_model(source)
    trained_from = pretrained.gguf_source(source.cfg["model_name"])
    origin = gguf_export.read_origin(trained_from) if trained_from is not None else None
    quantization = quantization or (origin.quantization if origin else None) or "f16"
    atomic.check_writable(out, "--output_file")  # before the model loads
    if ollama is not None:
        atomic.check_writable(ollama, "--ollama_modelfile")
    with _refused_writes(out):
        result, text = _gguf_file(source, out, quantization, origin, ollama)
    if text is not None and not atomic.create_text(ollama, text):
        raise UserError(f"--ollama_modelfile {ollama}: another process wrote it meanwhile")
    return {"format": "gguf", "out": str(out), "base_model": source.cfg["model_name"],
            "source": str(source.folder), "quantization": quantization, "architecture": result["architecture"],
            "tensors": len(result["tensors"]), "from_gguf": str(trained_from) if trained_from else None,
            "ollama_modelfile": str(ollama) if ollama else None}


def _gguf_file(source: Source, out_file: Path, quantization: str, origin: gguf_export.Origin | None,
               ollama_modelfile: Path | None) -> tuple[dict[str, Any], str | None]:
    """Merge the run into a temporary folder beside out_file, write and re-read the GGUF file there, then publish
    it under its name (never over a file); returns what gguf_export wrote and the Modelfile's text."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_file.name}.", suffix=".tmp", dir=out_file.parent) as tmp:
        merged, written = Path(tmp) / "merged", Path(tmp) / out_file.name
        merged.mkdir()
        _merged_into(merged, source, out_file)
        tokenizer = AutoTokenizer.from_pretrained(merged)
        with _refused_writes(out_file, lambda: gguf_export.estimated_bytes(merged, quantization)):
            result = gguf_export.write(merged, written, quantization, origin)
        gguf_export.check(written, result, tokenizer.chat_template)
        text = modelfile.modelfile_text(out_file, ollama_modelfile, tokenizer) if ollama_modelfile else None
        if not atomic.publish_new(written, out_file):
            raise UserError(f"--output_file {out_file}: another process wrote it meanwhile; nothing was replaced")
    return result, text


def _check_gguf_model(source: Source) -> None:
    """Refuse, before any model loads, what GGUF export does not write: a classifier head, or an architecture
    llama.cpp's Llama / Qwen2 graphs do not run."""
    cfg, trust_remote_code = source.cfg, source.trust_remote_code
    name = cfg["model_name"]
    head = pretrained.resolve_head(trained.run_head(cfg, name, trust_remote_code), name, trust_remote_code)
    if head != "lm":
        raise UserError(f"{name}: the run's model is not a causal LM (--head {head}); GGUF export writes causal LMs")
    if not source.is_adapter:  # full fine-tuning: the folder is the model
        config = json.loads((source.folder / "config.json").read_text(encoding="utf-8"))
    elif name in pretrained.RANDOM_MODELS:
        config = AutoConfig.for_model(pretrained.RANDOM_MODELS[name][0]).to_dict()
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    else:
        config = AutoConfig.from_pretrained(pretrained.resolve_path(name), trust_remote_code=trust_remote_code).to_dict()
    gguf_export.check_architecture(config, name)


# --format NAME -> the format (cli.py's --format choices are pinned to these names by a test)
FORMATS: dict[str, Format] = {
    "peft": Format("output_dir", "DIR", ("rank",), _write_peft),
    "merged": Format("output_dir", "DIR", (), _write_merged),
    "gguf": Format("output_file", "FILE.gguf", ("quantization", "ollama_modelfile"), _write_gguf),
}
