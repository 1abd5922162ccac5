"""Fault injection for tests: run the `xgblora` command in a child process that SIGKILLs itself the moment it opens
a file for writing whose name matches a pattern (the file is created, nothing is written: a write cut short)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

# `python -c DIE_ON_WRITE PATTERN ARGS...`: the xgblora command, except that Python's open() (builtins.open and
# io.open, which pathlib uses) kills the process on opening for writing a file whose name matches PATTERN
DIE_ON_WRITE = """
import builtins, io, os, re, signal, sys

pattern, real_open = re.compile(sys.argv[1]), io.open

def dying_open(file, mode="r", *args, **kwargs):
    handle = real_open(file, mode, *args, **kwargs)
    named = isinstance(file, (str, bytes, os.PathLike))
    if named and set(mode) & set("wax+") and pattern.search(os.path.basename(os.fsdecode(file))):
        os.kill(os.getpid(), signal.SIGKILL)
    return handle

io.open = builtins.open = dying_open
from xgblora import cli
sys.exit(cli.main(sys.argv[2:]))
"""


def run_dying_on_write(pattern: str, args: list[str], stderr_path: Path) -> int:
    """Run `xgblora ARGS` until it opens a file matching `pattern` for writing; return the exit status, which is
    -SIGKILL when it got there."""
    with open(stderr_path, "wb") as stderr:
        return subprocess.run([sys.executable, "-c", DIE_ON_WRITE, pattern, *args], stdout=subprocess.DEVNULL,
                              stderr=stderr, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300).returncode


KILLED = -signal.SIGKILL
