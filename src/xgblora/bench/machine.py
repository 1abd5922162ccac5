"""What machine and library versions a benchmark's figures come from, written beside every suite's figures."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
from typing import Any

import torch
import transformers

from xgblora.models.pretrained import choose_device


def _versions() -> dict[str, str | None]:
    """Versions of Python and of the libraries whose speed is measured."""
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                       "transformers": transformers.__version__}
    for pkg in ("peft", "accelerate", "trl"):
        if importlib.util.find_spec(pkg) is not None:
            versions[pkg] = __import__(pkg).__version__
    return versions


def machine_record(args: argparse.Namespace) -> dict[str, Any]:
    """The machine, the library versions, the date and the common sizes of a run."""
    device = choose_device(args.device)
    return {
        "batch_size": args.batch_size, "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup,
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "versions": _versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
