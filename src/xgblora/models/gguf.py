"""GGUF checkpoints (llama.cpp's single-file format) as model sources: dequantised once, then read as a folder.

transformers reads a GGUF file with `from_pretrained(folder, gguf_file=name)` and dequantises every tensor to fp32,
which takes tens of seconds even for a small model. `dequantised_folder` does that once per file and keeps the
result as an ordinary model folder (config.json, model.safetensors, the tokenizer with its chat template) in the
user cache, keyed by the SHA-256 of the file's bytes, so every later load is a safetensors read. The folder is
written under a temporary name and renamed into place, so a killed conversion leaves nothing a later load would
trust, and processes converting the same file at once (torchrun ranks) keep one complete copy.

The weights are the quantised model's, dequantised: a Q4_1 file gives the 4-bit model in fp32, not the original
bf16 checkpoint it was quantised from.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import logging
import os
from pathlib import Path

from xgblora import atomic
from xgblora.errors import UserError

log = logging.getLogger("xgblora")

# The environment variable that moves the cache; else $XDG_CACHE_HOME/xgblora/gguf, else ~/.cache/xgblora/gguf.
CACHE_ENV = "XGBLORA_CACHE"


def cache_dir() -> Path:
    """Where dequantised GGUF checkpoints are kept (`xgblora env` prints it)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser() / "gguf"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "xgblora" / "gguf"


def local_file(name: str) -> Path:
    """The GGUF file a name points at: a local path, else owner/repo/FILE.gguf fetched into the hub cache."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    parts = name.split("/")
    if path.is_absolute() or name.startswith((".", "~")) or len(parts) < 3 or Path(parts[0]).exists():
        raise UserError(f"model {name!r}: no such GGUF file")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:])))
    except Exception as exc:  # offline, unknown repository or file: the hub client raises many kinds
        raise UserError(f"model {name!r}: not a local GGUF file, and not downloadable from the hub as repository "
                        f"{'/'.join(parts[:2])!r}, file {'/'.join(parts[2:])!r} ({exc.__class__.__name__})") from None


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:  # size and mtime key the memo: a changed file is re-read
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes, computed once per process for an unchanged file."""
    stat = path.stat()
    return _digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def dequantised_folder(name: str) -> Path:
    """The model folder holding the GGUF checkpoint `name` dequantised (converted on first use, see above)."""
    path = local_file(name)
    folder = cache_dir() / file_digest(path)  # the same bytes under another name or folder share one copy
    if (folder / "config.json").is_file():
        return folder
    log.info("dequantising %s once into %s (later loads read it from there)", path, folder)
    with atomic.created_folder(folder) as tmp:
        _convert(path, tmp)
    return folder


def _convert(path: Path, out: Path) -> None:
    """Dequantise a GGUF file with transformers and save it as a model folder (fp32 safetensors)."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"model {str(path)!r}: reading GGUF files needs the gguf package (pip install gguf)")
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise UserError(f"{path}: cannot read this GGUF checkpoint with transformers ({first})") from None
    # the model is an ordinary fp32 model now; its config keeps the GGUF marker that forbids saving it
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})  # stores a tied weight once
    tokenizer.save_pretrained(out)

