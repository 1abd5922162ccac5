"""Outputs written whole: each file or folder is written under a hidden temporary name beside its place, fsynced,
then renamed into place. A path that exists therefore holds a complete output; a kill part-way leaves the previous
output (or none) and a hidden `.NAME.tmp`, which the next write of that output removes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from xgblora.errors import UserError


def temporary_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp")


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX: the directory entry is data of the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole: readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    """write_bytes of UTF-8 text."""
    write_bytes(path, text.encode("utf-8"))


def jsonl(rows: Iterable[dict[str, Any]]) -> str:
    """Rows as JSON Lines text (UTF-8 kept as it is, one object per line)."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def jsonl_rows(text: str) -> list[Any]:
    """The rows of JSON Lines text that jsonl() wrote. Lines end at "\\n" only: str.splitlines() also splits at
    U+0085, U+2028, U+2029 and other separators, which JSON keeps unescaped inside strings (a completion's text)."""
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """write_text of rows as JSON Lines."""
    write_text(path, jsonl(rows))


def create_text(path: Path, text: str) -> bool:
    """Write UTF-8 text to `path` whole if no file is there; False (nothing written) if one is.

    The text is written under a temporary name and hard-linked into place: link() fails when the name exists, so
    two writers never replace each other's file and a kill never leaves a part of one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def publish_new(tmp: Path, path: Path) -> bool:
    """Move the finished file `tmp` to `path` (same file system) if no file is there; False (tmp kept) if one is.
    link() refuses an existing name, so an existing file is never replaced, not even by a writer racing this one."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    Path(tmp).unlink()
    fsync_dir(Path(path).parent)
    return True


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


@contextlib.contextmanager
def created_folder(path: Path) -> Iterator[Path]:
    """Yield an empty temporary folder (this writer's own) to fill; when the block ends, rename it to `path` unless
    another writer put one there first, in which case that one is kept and ours removed. Either way `path` then
    holds a complete folder; when the block raises, nothing is left behind (a killed process leaves a hidden
    `.NAME.*.tmp` folder, never a partial `path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        try:
            os.rename(tmp, path)  # refused (ENOTEMPTY / EEXIST) when another writer's folder is already there
        except OSError:
            if not path.is_dir():
                raise
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def replaced_folder(path: Path) -> Iterator[Path]:
    """Yield an empty temporary folder to fill; when the block ends, swap it in for `path` (a previous `path` is
    removed after the swap). When the block raises, the temporary folder is removed and `path` is left as it was."""
    path = Path(path)
    tmp, old = temporary_name(path), path.with_name(f".{path.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed write
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():  # the swap itself failed: put the previous output back
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def size(n: int) -> str:
    """n bytes for a person: '512 bytes', '3.2 MiB', '1.5 GiB'."""
    if n < 2**20:
        return f"{n:,} bytes"
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _nearest_existing(path: Path) -> Path:
    """path, or the nearest of its parents that exists (where writing it would start)."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


# what a disk that refuses a write says: full, over quota, a file too large for it, an I/O error
_REFUSED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def disk_refused(exc: BaseException) -> bool:
    """Whether an error is a write the disk refused (by its errno), not a failure to read or load: safetensors
    reports one without an errno, as "Error while serializing: I/O error: No space left on device"."""
    if isinstance(exc, OSError):
        return exc.errno in _REFUSED
    return "while serializing" in str(exc)


def failed_write(path: Path, exc: BaseException, needed: int | None, advice: str, what: str = "write") -> UserError:
    """The one line a failed write (a full disk, a quota, an I/O error) ends in: the output, why, the space it
    needs when known and the space free on that disk, then what to do."""
    free = shutil.disk_usage(_nearest_existing(Path(path).parent)).free
    need = f"it needs about {size(needed)} and " if needed else ""
    return UserError(f"could not {what} {path} ({exc.__class__.__name__}: {exc}); {need}{size(free)} are free on "
                     f"that disk. {advice}")


@contextlib.contextmanager
def write_errors(path: Path, advice: str, needed: Callable[[], int] | None = None, what: str = "write",
                 errors: tuple[type[BaseException], ...] = (OSError,), disk_only: bool = False) -> Iterator[None]:
    """An error of `errors` raised in the block ends in failed_write's one line for path (with the space `needed`
    tells, computed only then). disk_only: only a write the disk refused does (disk_refused); any other error goes
    on as it was, for a block that also reads or loads, whose failures are no write's."""
    try:
        yield
    except errors as exc:
        if disk_only and not disk_refused(exc):
            raise
        raise failed_write(path, exc, needed() if needed else None, advice, what) from None


def check_path(value: str | None, flag: str) -> None:
    """Refuse an empty output path: Path("") is the working directory, which a command would then write into."""
    if value is not None and not str(value).strip():
        raise UserError(f"{flag} is empty; give the path to write to")


def check_writable(path: Path, flag: str, folder: Path | None = None) -> None:
    """Refuse in one line, before any model loads, an output the process cannot write: a file where a folder of
    its path should be, or a folder it may not write in (a read-only mount, another user's folder). A probe file
    is created and removed in `folder` (default: path's), or in the nearest parent of it that exists."""
    path = Path(path)
    folder = Path(folder) if folder is not None else path.parent
    blocked = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise UserError(f"{flag} {path}: {blocked} is a file, not a folder; choose another path")
    where = _nearest_existing(folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".xgblora-probe.", suffix=".tmp", dir=where)
    except OSError as exc:  # EROFS, EACCES; ENOSPC when not even an empty file fits
        raise UserError(f"{flag} {path}: cannot write in {where} ({exc.strerror or exc}); choose a folder you can "
                        f"write to") from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def output_folder(path: Path, flag: str) -> Iterator[Path]:
    """Create an output folder (and its parents) for the block; a file in its way, or a folder this process may
    not write in, is a one-line UserError, and the folders created here are removed again if the block fails
    while they are still empty."""
    path = Path(path)
    check_writable(path, flag, folder=path)
    created = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot create it ({exc.strerror or exc})") from None
    try:
        yield path
    except BaseException:
        for folder in created:  # innermost first; a folder that holds anything stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise
