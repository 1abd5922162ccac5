"""The run lock: one run at a time owns an output folder.

A run holds an exclusive flock on OUTPUT_DIR/xgblora.lock while it runs, and the file names it (host, process id,
start time) for the error a second run prints. The kernel drops a flock when its process dies, SIGKILL included,
so the file a killed run leaves behind is stale at once: a run on the same host takes it over and says whose it
was. A lock file from another host is not taken over (a flock may not reach across hosts): the user removes it.
Written here rather than taken from a package (filelock) because the error must name the holder and a takeover
must be reported.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from xgblora.errors import UserError
from xgblora.outputs import LOCK_NAME

log = logging.getLogger("xgblora")


@contextlib.contextmanager
def run_lock(folder: Path, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Own `folder` for the block: UserError at once when another run owns it; the lock file is removed after.

    `check` runs once no live run holds the folder, before this run takes a dead one's lock over: a run that it
    refuses leaves the folder as it found it."""
    path = Path(folder) / LOCK_NAME
    fd = _acquire(path, check)
    try:
        yield
    finally:
        if fd is not None:
            path.unlink(missing_ok=True)  # while still locked: a run waiting on this file sees it replaced
            os.close(fd)


def _acquire(path: Path, check: Callable[[], None]) -> int | None:
    """Lock path, run check, and write this process into it; None where the file system refuses locks."""
    existed = path.exists()
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(f"{path.parent} is in use by another run ({_describe(holder)}); wait for it to finish, "
                            f"stop it, or choose another --output_dir") from None
        except OSError as exc:  # some network and cluster mounts have no locks (ENOLCK, ENOSYS)
            os.close(fd)
            log.warning("%s: cannot lock it (%s); a second run into this folder will not be stopped", path, exc)
            check()
            return None
        if _still_at(fd, path):
            break
        os.close(fd)  # its holder removed the file between our open and our lock: lock the new file
    try:
        check()
    except BaseException:
        if not existed:
            path.unlink(missing_ok=True)
        os.close(fd)
        raise
    _take_over(fd, path)
    return fd


def _still_at(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _take_over(fd: int, path: Path) -> None:
    """Write this process into the locked file; a record already there is a run that died holding it."""
    stale, host = _read(fd), socket.gethostname()
    if stale and stale.get("host") != host:
        os.close(fd)
        raise UserError(f"{path} names a run on another host ({_describe(stale)}), which this host cannot check; "
                        f"if that run is over, delete {path} and start again")
    if stale:
        log.warning("%s: taking over the lock of a run that is gone (%s)", path.parent, _describe(stale))
    record = {"host": host, "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
    os.fsync(fd)


def _holder(fd: int, patience_s: float = 2.0) -> dict[str, Any]:
    """The record of the run holding the lock. It writes the record just after it locks, so a run that lost the race
    by microseconds (two jobs started together: seen in tests) waits a little for it."""
    deadline = time.monotonic() + patience_s
    while not (record := _read(fd)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return record


def _read(fd: int) -> dict[str, Any]:
    """The holder's record ({} when empty or unreadable: a holder that has not written it yet, or a torn one)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return f"process {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
