"""Outputs written whole: a failure at any point leaves the previous output as it was and no temporary behind."""

import errno
import os

import pytest

from xgblora import atomic
from xgblora.errors import UserError


def test_write_text_replaces_whole_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    atomic.write_text(path, "old")

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_text(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_write_errors_end_a_failed_write_in_one_line_and_disk_only_lets_other_errors_through(tmp_path):
    """Every OSError of the block becomes failed_write's line (the space needed computed only then); disk_only
    converts the writes the disk refused, by errno or by safetensors' message, and lets a permission error be."""
    out, asked = tmp_path / "out.jsonl", []

    def needed() -> int:
        asked.append(out)
        return 3 * 2**20

    with atomic.write_errors(out, "Free some space.", needed):
        out.write_text("fits")
    assert asked == []
    for error, disk_only in ((OSError(errno.ENOSPC, "No space left on device"), True),
                             (PermissionError(errno.EACCES, "Permission denied"), False)):
        with pytest.raises(UserError) as info, atomic.write_errors(out, "Free some space.", needed,
                                                                   disk_only=disk_only):
            raise error
        assert str(info.value).startswith(f"could not write {out} ({type(error).__name__}: {error}); it needs "
                                          f"about 3.0 MiB and ") and str(info.value).endswith(" Free some space.")
    with pytest.raises(PermissionError), atomic.write_errors(out, "advice", disk_only=True):
        raise PermissionError(errno.EACCES, "Permission denied")
    serializing = ValueError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(UserError, match="^could not export "), atomic.write_errors(
            out, "advice", what="export", errors=(ValueError,), disk_only=True):
        raise serializing
    assert asked == [out, out]


def test_replaced_folder_swaps_in_the_new_folder_only_when_the_block_ends(tmp_path):
    folder = tmp_path / "final"
    with atomic.replaced_folder(folder) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic.replaced_folder(folder) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError("killed part-way")
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and [p.name for p in folder.iterdir()] == ["a"]
    with atomic.replaced_folder(folder) as tmp:
        (tmp / "c").write_text("3")
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and [p.name for p in folder.iterdir()] == ["c"]


def test_a_failed_swap_puts_the_previous_folder_back(tmp_path, monkeypatch):
    folder = tmp_path / "final"
    with atomic.replaced_folder(folder) as tmp:
        (tmp / "a").write_text("1")
    real, calls = os.replace, []

    def second_fails(src, dst):  # the old folder moves aside, then the new one fails to move in
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", second_fails)
    with pytest.raises(OSError, match="Input/output error"), atomic.replaced_folder(folder) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and [p.name for p in folder.iterdir()] == ["a"]


def test_created_folder_appears_whole_keeps_the_first_writers_and_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "model"
    with atomic.created_folder(target) as first:
        (first / "weights").write_text("first")
        assert not target.exists()  # nothing at the name until the block ends
        with atomic.created_folder(target) as second:  # another writer finishes first
            (second / "weights").write_text("second")
    assert (target / "weights").read_text() == "second"  # the later rename is refused: one complete folder
    with pytest.raises(RuntimeError), atomic.created_folder(tmp_path / "other") as tmp:
        (tmp / "part").write_text("x")
        raise RuntimeError("killed half-way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folder left either way


def test_jsonl_rows_split_at_newlines_only_so_unicode_line_separators_stay_in_their_strings():
    rows = [{"text": "a\u2028b\u0085c\u2029d"}, {"text": "second"}]
    text = atomic.jsonl(rows)
    assert len(text.splitlines()) > len(rows)  # what str.splitlines() would have parsed
    assert atomic.jsonl_rows(text) == rows
