"""Fault injection for tests: run the `xgblora` command in a child process that SIGKILLs itself the moment it opens
a file for writing whose name matches a pattern (the file is created, nothing is written: a write cut short); a
fork server that launches many runs quickly, for a test to kill at random moments; a folder made read-only, and a
disk that fills up, for this process."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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


# `python -c FORK_SERVER`: reads one JSON [args, stderr path] a line; forks a child that runs `xgblora ARGS` with
# stderr to that file, and prints the child's pid, then (when it ends) its exit status (-9: SIGKILL)
FORK_SERVER = """
import json, os, sys, traceback
from xgblora import cli  # torch, transformers and xgblora imported once, before any fork
from xgblora.recipes import sft

for line in sys.stdin:
    args, stderr_path = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            code = cli.main(args)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class ForkServer:
    """Launches `xgblora ARGS` as forks of one process that has imported torch and xgblora: a launch starts in well
    under a second instead of about four, so a soak test can kill and resume a run many times within CI's time.
    Each launch is a process of its own, killed and resumed like any other."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def start(self, args: list[str], stderr_path: Path) -> int:
        """Launch `xgblora ARGS` (stderr to stderr_path); return its pid."""
        self.proc.stdin.write(json.dumps([args, str(stderr_path)]) + "\n")
        self.proc.stdin.flush()
        return int(self.lines.get(timeout=60))

    def wait(self, timeout: float) -> int | None:
        """The exit status of the last launch, or None when it is still running after `timeout` seconds."""
        try:
            return int(self.lines.get(timeout=timeout))
        except queue.Empty:
            return None

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _inside(path: object, folder: str) -> bool:
    where = os.path.realpath(os.path.dirname(os.path.abspath(os.fsdecode(path))))
    return where == folder or where.startswith(folder + os.sep)


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """Make `folder` read-only for this process as a read-only mount is: chmod 555, and (since root writes through
    a chmod) creating, opening for writing or making a folder in it fails with EROFS."""
    root = os.path.realpath(folder)
    real_os_open, real_io_open, real_mkdir = os.open, io.open, os.mkdir

    def refuse(path: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _inside(path, root):
            refuse(path)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def io_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+") and _inside(file, root):
            refuse(file)
        return real_io_open(file, mode, *args, **kwargs)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if _inside(path, root):
            refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", os_open)
        patch.setattr(io, "open", io_open)
        patch.setattr(builtins, "open", io_open)
        patch.setattr(os, "mkdir", mkdir)
        os.chmod(folder, 0o555)
        try:
            yield
        finally:
            os.chmod(folder, 0o755)


def full_disk_at_fsync(monkeypatch: pytest.MonkeyPatch, fails: Callable[[str], bool]) -> None:
    """A disk that fills up: os.fsync of a file whose path `fails` accepts raises ENOSPC, as a file system with
    delayed allocation reports a full disk (the bytes written so far stay in the file)."""
    real = os.fsync

    def fsync(fd):
        number = fd if isinstance(fd, int) else fd.fileno()
        if fails(os.readlink(f"/proc/self/fd/{number}")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
