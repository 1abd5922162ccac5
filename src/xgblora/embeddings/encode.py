"""`xgblora encode`: unit-length embeddings of one text field of a file, written to .npy or .safetensors.

The model is a trained run's folder (its adapter merged in memory; pooling, attention direction, prefixes and
max_length from its config.yaml), or any model `--model_name` takes (a merged export, a sentence-transformers
folder, `pkg:`, a hub id), pooled as its sentence-transformers config says.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import save

from xgblora import atomic
from xgblora.adapters.trained import load_run_model
from xgblora.data.pairs import embedding_prefixes
from xgblora.data.sources import read_rows
from xgblora.data.tasks import Fields
from xgblora.embeddings.pooling import encode_texts
from xgblora.errors import UserError, located
from xgblora.models import pretrained


@dataclass
class EncodeOptions:
    """What `xgblora encode` was asked for (None: the run's or the model's own setting)."""

    model: str
    input_file: str
    output_file: str
    column: str = "text"
    role: str = "query"  # which instruction prefix of a run applies: query or document
    prefix: str | None = None
    pooling: str | None = None
    max_length: int | None = None
    bidirectional: bool | None = None
    batch_size: int = 32
    device: str = "auto"
    trust_remote_code: bool = False


def _st_max_length(path: str) -> int | None:
    try:
        return int(json.loads((Path(path) / "sentence_bert_config.json").read_text())["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_encoder(opts: EncodeOptions) -> tuple[Any, Any, dict[str, Any]]:
    """The model, its tokenizer and its settings (pooling, max_length, bidirectional, prefix)."""
    run_dir = Path(opts.model)
    if (run_dir / "config.yaml").is_file():
        model, tokenizer, cfg = load_run_model(run_dir, opts.trust_remote_code)
        prefixes = embedding_prefixes(cfg.get("instruction_format") or "plain", cfg.get("query_instruction") or "",
                                      cfg.get("doc_instruction") or "")
        settings = {"pooling": cfg.get("pooling"), "max_length": cfg.get("max_length"),
                    "bidirectional": bool(cfg.get("bidirectional")),
                    "prefix": prefixes.doc if opts.role == "document" else prefixes.query,
                    "include_prompt": cfg.get("include_prompt") is not False}
    else:
        kind = pretrained.embedding_head(opts.model, "contrastive", opts.trust_remote_code)
        model, tokenizer = pretrained.load(opts.model, device="cpu", trust_remote_code=opts.trust_remote_code, head=kind)
        path = pretrained.resolve_path(opts.model)
        settings = {"pooling": pretrained.sentence_pooling(opts.model) or ("last" if kind == "lm" else "mean"),
                    "max_length": _st_max_length(path) or 512, "bidirectional": False, "prefix": "",
                    "include_prompt": True}
    given = {"pooling": opts.pooling, "max_length": opts.max_length, "bidirectional": opts.bidirectional,
             "prefix": opts.prefix}
    settings.update({k: v for k, v in given.items() if v is not None})
    if settings["pooling"] not in ("mean", "cls", "last"):
        raise UserError(f"{opts.model}: no pooling to embed with ({settings['pooling']!r}); pass --pooling mean|cls|last")
    return model.to(pretrained.choose_device(opts.device)), tokenizer, settings


def encode_file(opts: EncodeOptions) -> dict[str, Any]:
    """Embed the --column field of every row of --input_file; write --output_file (never over an existing file)."""
    atomic.check_path(opts.output_file, "--output_file")
    out = Path(opts.output_file)
    if out.suffix not in (".npy", ".safetensors"):
        raise UserError(f"--output_file {out}: name a .npy or .safetensors file")
    if out.exists():
        raise UserError(f"--output_file {out}: exists; choose a new file name (xgblora does not overwrite your files)")
    texts = [_text(row, where, opts.column) for where, row in read_rows(opts.input_file)]
    pretrained.check_name(opts.model)
    pretrained.choose_device(opts.device)  # a device this machine lacks: said before the model loads
    with atomic.output_folder(out.parent, "--output_file"):
        return _encode(opts, texts, out)


def _text(row: dict[str, Any], where: Any, column: str) -> str:
    if column not in row:
        raise located(where[0], where[1], column, f"missing; the row has: {', '.join(map(str, row)) or 'no fields'} "
                                                  f"(--column NAME picks the field holding the text)")
    return Fields(row, where).text(column)


def _encode(opts: EncodeOptions, texts: list[str], out: Path) -> dict[str, Any]:
    model, tokenizer, settings = load_encoder(opts)
    vectors = encode_texts(model, tokenizer, texts, pooling=settings["pooling"], max_length=int(settings["max_length"]),
                           batch_size=opts.batch_size, bidirectional=settings["bidirectional"],
                           prefix=settings["prefix"], include_prompt=settings["include_prompt"])
    if out.suffix == ".npy":
        buffer = io.BytesIO()
        np.save(buffer, vectors.numpy(), allow_pickle=False)
        atomic.write_bytes(out, buffer.getvalue())
    else:
        atomic.write_bytes(out, save({"embeddings": vectors.contiguous()}))
    return {"output_file": str(out), "rows": len(texts), "dim": int(vectors.shape[1]) if vectors.numel() else 0, **settings}
