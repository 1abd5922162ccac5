"""Run logging: a buffered JSONL metrics log (one file handle per run, mirrored to --report_to trackers) and the
console logger."""

from __future__ import annotations

import json
import logging as std_logging
import numbers
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from xgblora.errors import UserError, located

if TYPE_CHECKING:
    from accelerate.tracking import GeneralTracker

LOGGER_NAME = "xgblora"
_log = std_logging.getLogger(LOGGER_NAME)


def _jsonable(value: Any) -> Any:
    """json.dumps fallback: tensors and numpy scalars become Python numbers, paths become strings."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"a metrics record value of type {type(value).__name__} is not JSON serialisable")


def _parse(data: bytes, path: Path) -> tuple[list[dict], list[int], bool]:
    """Parse JSONL bytes into (records, byte offset of each record's line, whether the last line is torn).

    A torn last line (cut by a kill mid-write: no newline, or not valid JSON) is left out; an unparseable
    line before the last one is corruption, not a tear, and raises UserError naming the line.
    """
    records: list[dict] = []
    offsets: list[int] = []
    lines = data.split(b"\n")
    start = 0
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for number, line in enumerate(lines):
        offset, start = start, start + len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if number == last:
                return records, offsets, True
            raise located(path, number + 1, None, "not a JSON object; the metrics log is corrupt (fix or delete the line)")
        records.append(record)
        offsets.append(offset)
    return records, offsets, False


def read_metrics(path: Path) -> list[dict]:
    """Read metrics.jsonl into a list of records, skipping (and logging) a torn last line left by a killed run."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the metrics log ({exc.__class__.__name__}: {exc})") from None
    records, _, torn = _parse(data, path)
    if torn:
        _log.warning("%s: skipped 1 torn last line (the run was interrupted mid-write or is still writing)", path)
    return records


class MetricsLog:
    """Append-only JSONL metrics of one run: one file handle for the whole run, records buffered and written in batches.

    A fresh log (resume=False) starts the file empty. With resume=True the existing records are kept, a torn
    last line left by a kill is dropped (with a warning), and, when resume_step is given, records logged after
    that step (after the checkpoint being resumed, so about to be logged again) are dropped too.
    Records reach the file every `flush_every` records or `flush_interval_s` seconds, whichever comes first;
    flush() also fsyncs (at checkpoints and exit).
    """

    def __init__(self, path: Path, flush_every: int = 20, trackers: Sequence[GeneralTracker] = (),
                 resume: bool = False, *, resume_step: int | None = None, flush_interval_s: float = 30.0):
        if flush_every < 1:
            raise ValueError(f"flush_every must be at least 1, got {flush_every}")
        self.path = Path(path)
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self._pending: list[str] = []
        self.trackers = list(trackers)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a+b")  # noqa: SIM115 -- held for the run, closed by close()
        try:
            if resume:
                self._repair(resume_step)
            else:
                self._handle.truncate(0)
        except BaseException:
            self._handle.close()
            raise
        self._last_write = time.monotonic()

    def _repair(self, resume_step: int | None) -> None:
        """Cut the file after its last whole record (and after resume_step), so appended records stay parseable."""
        self._handle.seek(0)
        data = self._handle.read()
        records, offsets, torn = _parse(data, self.path)
        end = len(data)
        if torn:
            end = offsets[-1] + data[offsets[-1]:].index(b"\n") + 1 if records else 0
            warnings.warn(f"{self.path}: dropped a torn last line ({len(data) - end} bytes) left by an interrupted run",
                          stacklevel=3)
        if resume_step is not None:
            later = [i for i, r in enumerate(records) if isinstance(r.get("step"), int) and r["step"] > resume_step]
            if later:
                end = min(end, offsets[later[0]])
                _log.info("%s: dropped %d records logged after step %d; they are logged again on resume",
                          self.path, len(records) - later[0], resume_step)
        if end < len(data):
            self._handle.truncate(end)
        if end and not data[:end].endswith(b"\n"):
            self._handle.write(b"\n")
            self._handle.flush()

    def log(self, record: dict) -> None:
        """Append one record (it must have "step") as a JSON line; mirror its numbers to the trackers."""
        if "step" not in record:
            raise ValueError(f"a metrics record needs a 'step' key, got keys {sorted(record)}")
        if self._handle.closed:
            raise ValueError(f"{self.path}: the metrics log is closed")
        self._pending.append(json.dumps(record, default=_jsonable) + "\n")
        if self.trackers:
            self._mirror(record)
        if len(self._pending) >= self.flush_every or time.monotonic() - self._last_write >= self.flush_interval_s:
            self._write()

    def _mirror(self, record: dict) -> None:
        """Numeric fields as tracker scalars: train/<key>, eval/<metric> for eval_<metric>, <event>/<key> for events."""
        step, event = int(record["step"]), record.get("event")
        scalars = {}
        for key, value in record.items():
            if key in ("step", "event") or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            if event:
                tag = f"{event}/{key}"
            elif key.startswith("eval_"):
                tag = f"eval/{key[len('eval_'):]}"
            else:
                tag = f"train/{key}"
            scalars[tag] = value
        for tracker in self.trackers:
            tracker.log(scalars, step=step)

    def _write(self) -> None:
        """Hand the pending records to the OS in one write (whole lines only)."""
        if self._pending:
            self._handle.write("".join(self._pending).encode("utf-8"))
            self._pending.clear()
        self._handle.flush()
        self._last_write = time.monotonic()

    def flush(self) -> None:
        """Write every pending record and fsync, so that the file survives a crash (at checkpoints and exit)."""
        self._write()
        os.fsync(self._handle.fileno())
        for tracker in self.trackers:
            flush = getattr(getattr(tracker, "tracker", None), "flush", None)  # TensorBoard's writer has one
            if flush is not None:
                flush()

    def close(self) -> None:
        """Flush and close the file (and the TensorBoard writer); closing twice is harmless."""
        if self._handle.closed:
            return
        try:
            self.flush()
        finally:
            self._handle.close()
            for tracker in self.trackers:
                tracker.finish()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class ProgressLine:
    """Plain progress lines for a log that is not a terminal (nohup, SLURM, CI), where tqdm's bar is off: step,
    loss, learning rate, tokens/s (this process's non-padding input tokens) and the time left at this pace."""

    def __init__(self, max_steps: int, start_step: int, enabled: bool | None = None):
        self.max_steps, self.start_step, self.tokens = max_steps, start_step, 0
        self.enabled = not sys.stderr.isatty() if enabled is None else enabled
        self.started = time.perf_counter()

    def count(self, batch: Any) -> None:
        """Add a training batch's non-padding tokens (nothing to do when no line is printed)."""
        if self.enabled:
            self.tokens += batch.n_tokens()

    def report(self, step: int, loss: float | None, lr: float, shown: dict[str, float] | None = None) -> None:
        """Log one line (when enabled), with the `shown` metrics after the loss."""
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        left = (self.max_steps - step) * elapsed / max(step - self.start_step, 1)
        loss_text = f"{loss:.4f}" if loss is not None else "nan"
        extra = "".join(f"  {name} {value:.4g}" for name, value in (shown or {}).items())
        _log.info("step %d/%d  loss %s%s  lr %.3g  %.0f tokens/s  ETA %s", step, self.max_steps, loss_text, extra,
                  lr, self.tokens / elapsed, _duration(left))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class _ConsoleHandler(std_logging.Handler):
    """Writes each message as one line to the current sys.stderr, above any tqdm progress bar."""

    def emit(self, record: std_logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _plain(record: std_logging.LogRecord) -> bool:
    """A logging filter that takes terminal colour codes out of a message."""
    if isinstance(record.msg, str):
        record.msg = _ANSI.sub("", record.msg)
    return True


def plain_output() -> None:
    """Where stderr is no terminal (a log file, nohup, SLURM, CI): no progress bars redrawn by carriage returns, no
    colour codes. The Hugging Face libraries read their switches when first imported (the CLI calls this before), and
    transformers' load report writes its header in bold even when it colours nothing else."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("transformers.modeling_utils", "transformers.utils.loading_report"):  # who logs the report
        std_logging.getLogger(name).addFilter(_plain)


def setup_console_logging(level: int = std_logging.INFO) -> std_logging.Logger:
    """Route the "xgblora" logger to stderr, one line per message ("12:03:04 INFO    ..."); calling again only sets the level."""
    logger = std_logging.getLogger(LOGGER_NAME)
    handler = next((h for h in logger.handlers if isinstance(h, _ConsoleHandler)), None)
    if handler is None:
        handler = _ConsoleHandler()
        handler.setFormatter(std_logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level)
    handler.setLevel(level)
    logger.propagate = False
    # bitsandbytes warns on import, on every CPU machine without its optional `kernels` package, that its CPU 4-bit
    # kernel is unavailable; peft imports it whenever it is installed, so every run printed it, 4-bit or not.
    std_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(std_logging.ERROR)
    plain_output()
    return logger
