"""Capturing a handler's output in the worker, and shipping it in chunks while it runs.

What is captured, for the thread that runs the handler: records of `ctx.logger` (stream
`logger`), every other Python `logging` record emitted in that thread (stream `logging`,
Celery's task loggers included), and `sys.stdout` / `sys.stderr` writes (streams `stdout`,
`stderr`; a `\\r` ends a line too, so progress bars do not pile up). Each line gets its
number, timestamp, stream and level; it is cut at 16 K characters and secret-looking values
are redacted before it is buffered. Output written straight to file descriptors 1 and 2 (C
extensions, subprocesses), by threads the handler starts, or by processes it forks, is not
captured.

A shipper thread, started by the first line (most runs print nothing and start none),
sends the buffer as a chunk every `flush_interval_seconds`, or sooner when it holds
`flush_lines` lines or `flush_bytes` bytes. The handler only appends an
encoded line to a list under a lock: shipping never blocks it. When the log store cannot be
reached, chunks wait in memory (bounded by `buffer_max_bytes`; beyond it lines are dropped,
and a marker line at the gap says how many) and are sent again. What is left when the
handler returns is stored with the attempt's outcome (`logs_app.store.logs_seal`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
import threading
from typing import TextIO

from django.conf import settings
from django.db import connection

from jobs.models import Attempt
from jobs.redaction import RedactingFilter

from .store import Chunk, chunk_ship, clean_line, encode_line

log = logging.getLogger("logs_app.capture")
LIMIT_MARKER = (
    "[log truncated: this attempt reached its limit of {limit} bytes; {dropped} more lines dropped]"
)
GAP_MARKER = (
    "[{dropped} lines dropped here: the log store was unreachable and the worker's buffer was full]"
)

_captures: dict[int, LogCapture] = {}  # thread ident -> the capture of the handler it runs
_install_lock = threading.Lock()
_inside = threading.local()  # set while a thread is inside the capture (no re-entry)


class LogCapture:
    def __init__(self, attempt: Attempt, *, config: dict | None = None) -> None:
        self.attempt = attempt
        self.config = {**settings.SCHEDULER_LOGS, **(config or {})}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._lines: list[bytes] = []
        self._first_line = 0  # number of the first line in `_lines`
        self._bytes = 0
        self._pending: list[Chunk] = []  # formed, not yet stored
        self._next_line = 0
        self._next_sequence = 0
        self._written = 0  # bytes accepted for this attempt
        self._held = 0  # bytes in memory: lines and chunks not yet stored
        self._partial: dict[str, list[str]] = {}  # stream -> pieces after its last line end
        self._partial_size: dict[str, int] = {}
        self.dropped_for_limit = 0
        self._dropped_for_buffer = 0  # since the last gap marker
        self.dropped_for_buffer_total = 0
        self.stale = False
        self.shipped = 0  # chunks stored while the handler ran
        self._stopping = False
        self._finished: tuple[list[Chunk], int] | None = None
        # Made with the first line (under the lock): most runs print nothing, and a
        # Thread object (its locks and events) was 5% of a packed no-op run in a worker.
        self._thread: threading.Thread | None = None
        self._owner: int | None = None

    # -- the handler's side ----------------------------------------------------------
    def start(self) -> LogCapture:
        if not self.config["capture"]:
            return self  # nothing captured; finish() seals an empty, complete log
        _install()
        self._owner = threading.get_ident()
        _captures[self._owner] = self
        return self  # the shipper thread starts with the first line: most runs print nothing

    def emit(self, stream: str, level: str, text: str) -> None:
        now = dt.datetime.now(dt.UTC).isoformat()
        parts = text.splitlines() or [""]
        cleaned = [clean_line(part) for part in parts]  # outside the lock: it may take a while
        with self._lock:
            for part in cleaned:
                self._append(stream, level, part, now)
            if (
                len(self._lines) >= self.config["flush_lines"]
                or self._bytes >= self.config["flush_bytes"]
            ):
                self._wake.notify()

    def write(self, stream: str, text: str) -> None:
        """Stream output: whole lines are emitted (a `\\r` or `\\n` ends one); a partial
        line waits for its end, up to `flush_bytes`."""
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        *lines, rest = text.split("\n")
        pieces = self._partial.setdefault(stream, [])
        if lines:
            lines[0] = "".join(pieces) + lines[0]
            pieces.clear()
            self._partial_size[stream] = 0
        if rest:
            pieces.append(rest)
            self._partial_size[stream] = self._partial_size.get(stream, 0) + len(rest)
            if self._partial_size[stream] >= self.config["flush_bytes"]:
                lines.append("".join(pieces))  # a line with no end in sight: cut it here
                pieces.clear()
                self._partial_size[stream] = 0
        if lines:
            self.emit(stream, "INFO" if stream == "stdout" else "ERROR", "\n".join(lines))

    def _append(self, stream: str, level: str, text: str, now: str) -> None:
        if self.stale:
            return  # the attempt is no longer current: nothing it writes is kept
        if self._dropped_for_buffer and self._held < self.config["buffer_max_bytes"] // 2:
            # Room again: mark the gap where the dropped lines were.
            gap = GAP_MARKER.format(dropped=self._dropped_for_buffer)
            self._dropped_for_buffer = 0
            self._accept("system", "WARNING", gap, now)
        line_size = len(text) + 96  # the JSON around it, near enough
        if self._written + line_size > self.config["max_bytes_per_attempt"]:
            self.dropped_for_limit += 1
            return
        if self._held + line_size > self.config["buffer_max_bytes"]:
            self._dropped_for_buffer += 1
            self.dropped_for_buffer_total += 1
            return
        self._accept(stream, level, text, now)

    def _accept(self, stream: str, level: str, text: str, now: str) -> None:
        line = encode_line(self._next_line, now, stream, level, text)
        self._written += len(line)
        self._bytes += len(line)
        self._held += len(line)
        if not self._lines:
            self._first_line = self._next_line
        self._lines.append(line)
        self._next_line += 1
        if not self._stopping and self._thread is None:
            self._thread = threading.Thread(target=self._ship_loop, name="log-shipper", daemon=True)
            self._thread.start()

    def finish(self) -> tuple[list[Chunk], int]:
        """Stop shipping; (the chunks not yet stored, lines dropped) for `logs_seal`.
        Safe to call again (a soft time limit may interrupt the first call)."""
        if self._finished is not None:
            return self._finished
        if self._owner is not None:
            _captures.pop(self._owner, None)
        for stream, pieces in list(self._partial.items()):
            if pieces:
                self.emit(stream, "INFO" if stream == "stdout" else "ERROR", "".join(pieces))
        self._partial.clear()
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            now = dt.datetime.now(dt.UTC).isoformat()
            if self._dropped_for_buffer:
                self._accept("system", "WARNING",
                             GAP_MARKER.format(dropped=self._dropped_for_buffer), now)  # fmt: skip
            if self.dropped_for_limit:
                marker = LIMIT_MARKER.format(
                    limit=self.config["max_bytes_per_attempt"], dropped=self.dropped_for_limit
                )
                self._accept("system", "WARNING", marker, now)
            self._form_chunk()
            dropped = self.dropped_for_limit + self.dropped_for_buffer_total
            self._finished = (list(self._pending), dropped)
            return self._finished

    # -- the shipper thread ------------------------------------------------------------
    def _form_chunk(self) -> None:
        if self._lines:
            self._pending.append(
                Chunk(self._next_sequence, self._first_line, self._lines, size=self._bytes)
            )
            self._next_sequence += 1
            self._lines, self._bytes = [], 0

    def _ship_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._stopping:
                        self._wake.wait(timeout=self.config["flush_interval_seconds"])
                    if self._stopping:
                        return  # what is left is sealed with the outcome
                    self._form_chunk()
                    batch = list(self._pending)
                if batch and not self.stale:
                    self._ship(batch)
        finally:
            connection.close()

    def _ship(self, batch: list[Chunk]) -> None:
        now = dt.datetime.now(dt.UTC)
        for chunk in batch:
            try:
                stored = chunk_ship(attempt=self.attempt, chunk=chunk, now=now)
            except Exception:  # noqa: BLE001 - the database or any storage backend is away
                log.warning("log shipping failed; keeping %d chunks to retry", len(batch))
                connection.close()
                return
            with self._lock:
                self._pending.remove(chunk)
                self._held -= chunk.size
                self.shipped += 1
            if not stored:
                # The attempt is no longer current: it may add nothing to the run's logs.
                with self._lock:
                    self.stale = True
                    self._pending.clear()
                    self._lines, self._bytes, self._held = [], 0, 0
                return


class _ThreadStream:
    """sys.stdout/sys.stderr: writes from a handler's thread go to its capture, the rest
    to the stream that was there before."""

    def __init__(self, original: TextIO, name: str) -> None:
        self._original = original
        self._name = name

    def write(self, text: str) -> int:
        capture = _captures.get(threading.get_ident())
        if capture is None or getattr(_inside, "active", False):
            return self._original.write(text)
        _inside.active = True
        try:
            capture.write(self._name, text)
        except Exception:  # noqa: BLE001 - capturing must never fail the handler's print
            pass
        finally:
            _inside.active = False
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name):
        return getattr(self._original, name)


class _CaptureHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        capture = _captures.get(record.thread)
        if capture is None or getattr(_inside, "active", False):
            return
        _inside.active = True
        try:
            stream = "logger" if record.name.startswith("jobs.task.") else "logging"
            try:
                text = record.getMessage()
            except Exception:  # noqa: BLE001 - a bad format string must not break the handler
                text = str(record.msg)
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            capture.emit(
                stream, record.levelname, text if stream == "logger" else f"{record.name}: {text}"
            )
        except Exception:  # noqa: BLE001 - logging must never raise into the handler
            pass
        finally:
            _inside.active = False


def _forget_captures_in_child() -> None:
    # A process the handler forks is not the handler: its output goes to the worker's log,
    # and it must not wait on a lock held by a thread that does not exist in it.
    _captures.clear()


def _install() -> None:
    """Once per process: the stream proxies and the logging handler."""
    with _install_lock:
        if not isinstance(sys.stdout, _ThreadStream):
            sys.stdout = _ThreadStream(sys.stdout, "stdout")
        if not isinstance(sys.stderr, _ThreadStream):
            sys.stderr = _ThreadStream(sys.stderr, "stderr")
        # Celery's task loggers do not propagate to the root: they get the handler too.
        for name in ("", "celery.task"):
            target = logging.getLogger(name)
            # The worker's own handlers (Celery's) see a handler's records too: redacted.
            for handler in target.handlers:
                if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                    handler.addFilter(RedactingFilter())
            if not any(isinstance(h, _CaptureHandler) for h in target.handlers):
                target.addHandler(_CaptureHandler())
        # ctx.logger's records reach the root's handlers whatever the root's level.
        logging.getLogger("jobs.task").setLevel(logging.DEBUG)
        if not getattr(_install, "forked_hook", False):
            os.register_at_fork(after_in_child=_forget_captures_in_child)
            _install.forked_hook = True
