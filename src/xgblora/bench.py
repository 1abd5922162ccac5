"""Throughput, memory and limit-ratio measurements against baselines (`xgblora bench`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `xgblora bench`."""


def main(args: argparse.Namespace) -> int:
    """Run the benchmark and print its table."""
    print("xgblora bench: not implemented yet")
    return 2
