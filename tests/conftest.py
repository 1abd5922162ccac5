"""Shared test set-up: offline hub, the shared benchmark data, small helpers."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The GLUE/SuperGLUE JSONL folder beside the checkout (../shared/data)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


def forget_state_in(optimizer: torch.optim.Optimizer):
    """A Boosting `forget` callback: drop the optimizer state of the re-initialised weights (as the steppers do)."""
    return lambda params: [optimizer.state.pop(p, None) for p in params]
