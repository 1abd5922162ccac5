"""`xgblora bench`: the table of suites, and the command that runs the one `--suite` names.

A suite is a module with `run(args)` (its figures) and `format_table(figures)`. The train suite's figures are one
flat dict; every other suite's JSON holds its results under one key, beside the machine they were measured on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from xgblora import atomic
from xgblora.bench import compile as compile_suite
from xgblora.bench import dpo, embed, es, gpu, grpo, icl, kto, reward, sft, train_suite
from xgblora.bench.flags import apply_quick, check_sizes
from xgblora.bench.machine import machine_record
from xgblora.bench.table import format_table
from xgblora.errors import UserError

# suite -> (module, the JSON key of its list of results)
LISTED_SUITES = {"sft": (sft, "cases"), "icl": (icl, "tasks"), "compile": (compile_suite, "workloads"),
                 "grpo": (grpo, "cases"), "es": (es, "cases"), "embed": (embed, "cases"), "dpo": (dpo, "cases"),
                 "kto": (kto, "cases"), "reward": (reward, "cases")}


def run_suite(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The figures of the suite the flags name, and their printed table."""
    check_sizes(args)
    if args.suite == "train":
        res = train_suite.run(args)
        return res, format_table(res)
    if args.suite == "gpu":
        env = machine_record(args)
        report = gpu.run(args, save=lambda partial: gpu.write(Path(args.json), {"suite": "gpu", "environment": env,
                                                                                **partial}))
        return {"suite": "gpu", "environment": env, **report}, gpu.format_table(report)
    module, key = LISTED_SUITES[args.suite]
    results = module.run(apply_quick(args))
    return {"suite": args.suite, "environment": machine_record(args), key: results}, module.format_table(results)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark suite, print its table, and write the JSON when --json is given (the GPU suite: always,
    saved after each part). Neither the JSON nor its Markdown table is written over an existing file."""
    atomic.check_path(args.json, "--json")
    if args.suite == "gpu":
        args.json = args.json or "gpu-suite.json"
    if args.json and (taken := [p for p in (Path(args.json), Path(args.json).with_suffix(".md")) if p.exists()]):
        raise UserError(f"--json {args.json}: {taken[0]} already exists; bench never writes over a file, so name "
                        f"another")
    if args.json:  # before minutes of measuring: a folder it cannot write in
        atomic.check_writable(Path(args.json), "--json")
    with contextlib.redirect_stdout(sys.stderr):  # HF Trainer prints its summary; keep stdout for the table
        res, table = run_suite(args)
    print(table, flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"wrote {path}")
        if args.suite != "train":  # the other suites' tables are Markdown: kept beside the JSON
            path.with_suffix(".md").write_text(table + "\n", encoding="utf-8")
            print(f"wrote {path.with_suffix('.md')}")
    return 0
