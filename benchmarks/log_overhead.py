"""Cost per record of MetricsLog.log against a naive logger that opens and closes the file for every record.

Run: python benchmarks/log_overhead.py [--records 5000] [--dir /path/on/the/disk/to/test]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from xgblora.logs import MetricsLog


def naive_log(path: Path, record: dict) -> None:
    """The slow pattern from the original trainer: open, append one line, close, for every record."""
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def records(n: int) -> list[dict]:
    """Training-loop shaped records."""
    return [{"step": 10 * i, "loss": 1.0 / (i + 1), "lr": 1e-5, "elapsed_s": 0.3 * i} for i in range(n)]


def measure(n: int, folder: Path, repeats: int = 5) -> tuple[float, float]:
    """Best-of-repeats seconds per record for (MetricsLog incl. open and close, naive open-per-record)."""
    batch = records(n)
    best_log = best_naive = float("inf")
    for r in range(repeats):
        path = folder / f"buffered-{r}.jsonl"
        start = time.perf_counter()
        with MetricsLog(path) as log:
            for record in batch:
                log.log(record)
        best_log = min(best_log, (time.perf_counter() - start) / n)
        path = folder / f"naive-{r}.jsonl"
        start = time.perf_counter()
        for record in batch:
            naive_log(path, record)
        best_naive = min(best_naive, (time.perf_counter() - start) / n)
    return best_log, best_naive


def main() -> None:
    """Print microseconds per record for both loggers and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--dir", type=Path, default=None, help="folder to write in (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        per_log, per_naive = measure(args.records, Path(folder))
    print(f"MetricsLog.log      {per_log * 1e6:8.2f} us/record (open once, flush every 20, fsync at close)")
    print(f"open-per-record     {per_naive * 1e6:8.2f} us/record")
    print(f"naive / MetricsLog  {per_naive / per_log:8.1f}x  ({args.records} records, best of 5)")


if __name__ == "__main__":
    main()
