"""What checkpoint integrity costs: the SHA-256 manifest against the save and the load it guards.

A checkpoint of a given number of fp32 parameters with AdamW's two moments in state.pt (full fine-tuning; the
default, 125M, is OPT-125m), saved and loaded the way `xgblora train` does, with the manifest (write_manifest on
save, verify on load) timed on its own. Each figure is the median of --repeats.

    python benchmarks/checkpoint_integrity.py --params 125e6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from xgblora import checkpoint


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(root: Path, params: int) -> dict[str, float]:
    """Seconds to save, to write the manifest, to load (verifying) and to verify, for one checkpoint."""
    weights = {"w": torch.randn(params)}
    moments = {"stepper": {"exp_avg": torch.randn(params), "exp_avg_sq": torch.rand(params)}}
    save_s = timed(lambda: checkpoint.save(root, "step-1", weights, {"step": 1}, moments))
    folder = root / "step-1"
    return {"save_s": save_s, "manifest_s": timed(lambda: checkpoint.write_manifest(folder)),
            "load_s": timed(lambda: checkpoint.load(folder)), "verify_s": timed(lambda: checkpoint.verify(folder)),
            "gigabytes": sum(p.stat().st_size for p in folder.iterdir()) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=125e6, help="fp32 parameters (the weights file).")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(measure(Path(tmp), int(args.params)))
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    median["manifest_share_of_save"] = median["manifest_s"] / median["save_s"]
    median["verify_share_of_load"] = median["verify_s"] / median["load_s"]
    print(json.dumps({k: round(v, 3) for k, v in median.items()}, indent=2))


if __name__ == "__main__":
    main()
