"""Capturing a handler's output in the worker, and shipping it in chunks while it runs.

What is captured, for the thread that runs the handler: records of `ctx.logger` (stream
`logger`), every other Python `logging` record emitted in that thread (stream `logging`),
and `sys.stdout` / `sys.stderr` writes (streams `stdout`, `stderr`). Each line gets its
number, timestamp, stream and level; secret-looking values are redacted before anything is
buffered. Output written straight to file descriptors 1 and 2 (C extensions, subprocesses)
and by threads the handler starts is not captured.

A shipper thread sends the buffer as a chunk every `flush_interval_seconds`, or sooner
when it holds `flush_lines` lines or `flush_bytes` bytes. The handler only appends to a
list under a lock: shipping never blocks it. When the log store cannot be reached, chunks
wait in memory (bounded by `buffer_max_bytes`; beyond it lines are dropped and counted)
and are sent again. What is left when the handler returns is stored with the attempt's
outcome (`logs_app.store.logs_seal`).
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
import threading
from typing import TextIO

from django.conf import settings
from django.db import connection

from jobs.models import Attempt

from .store import Chunk, chunk_ship, redact

log = logging.getLogger("logs_app.capture")
TRUNCATED = (
    "[log truncated: this attempt reached its limit of {limit} bytes; {dropped} more lines dropped]"
)

_captures: dict[int, LogCapture] = {}  # thread ident -> the capture of the handler it runs
_install_lock = threading.Lock()


class LogCapture:
    def __init__(self, attempt: Attempt, *, config: dict | None = None) -> None:
        self.attempt = attempt
        self.config = {**settings.SCHEDULER_LOGS, **(config or {})}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._lines: list[dict] = []
        self._bytes = 0
        self._pending: list[Chunk] = []  # formed, not yet stored
        self._next_line = 0
        self._next_sequence = 0
        self._written = 0  # bytes accepted for this attempt
        self._held = 0  # bytes in memory: lines and chunks not yet stored
        self.dropped = 0
        self.stale = False
        self._stopping = False
        self._thread = threading.Thread(target=self._ship_loop, name="log-shipper", daemon=True)
        self._owner: int | None = None
        self._partial: dict[str, str] = {}  # stream -> text written after its last newline

    # -- the handler's side ----------------------------------------------------------
    def start(self) -> LogCapture:
        if not self.config["capture"]:
            return self  # nothing captured; finish() seals an empty, complete log
        _install()
        self._owner = threading.get_ident()
        _captures[self._owner] = self
        self._thread.start()
        return self

    def emit(self, stream: str, level: str, text: str) -> None:
        now = dt.datetime.now(dt.UTC).isoformat()
        with self._lock:
            for part in text.splitlines() or [""]:
                self._append(stream, level, redact(part), now)
            if (
                len(self._lines) >= self.config["flush_lines"]
                or self._bytes >= self.config["flush_bytes"]
            ):
                self._wake.notify()

    def write(self, stream: str, text: str) -> None:
        """Stream output: whole lines are emitted, a partial one waits for its end."""
        text = self._partial.pop(stream, "") + text
        *lines, rest = text.split("\n")
        if rest:
            self._partial[stream] = rest
        if lines:
            self.emit(stream, "INFO" if stream == "stdout" else "ERROR", "\n".join(lines))

    def _append(self, stream: str, level: str, text: str, now: str) -> None:
        size = len(text.encode()) + 64
        limit = self.config["max_bytes_per_attempt"]
        if self._written + size > limit or self._held + size > self.config["buffer_max_bytes"]:
            self.dropped += 1
            return
        self._written += size
        self._bytes += size
        self._held += size
        self._lines.append(
            {"n": self._next_line, "ts": now, "stream": stream, "level": level, "text": text}
        )
        self._next_line += 1

    def finish(self) -> tuple[list[Chunk], int]:
        """Stop shipping; (the chunks not yet stored, lines dropped) for `logs_seal`."""
        if self._owner is not None:
            _captures.pop(self._owner, None)
        for stream in list(self._partial):
            self.write(stream, "\n")
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            self._form_chunk()
            if self.dropped:
                marker = TRUNCATED.format(
                    limit=self.config["max_bytes_per_attempt"], dropped=self.dropped
                )
                self._pending.append(
                    Chunk(
                        self._next_sequence,
                        self._next_line,
                        [{"n": self._next_line, "ts": dt.datetime.now(dt.UTC).isoformat(),
                          "stream": "system", "level": "WARNING", "text": marker}],
                    )
                )  # fmt: skip
                self._next_sequence += 1
            return list(self._pending), self.dropped

    # -- the shipper thread ------------------------------------------------------------
    def _form_chunk(self) -> None:
        if self._lines:
            self._pending.append(
                Chunk(self._next_sequence, self._lines[0]["n"], self._lines, size=self._bytes)
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
            if not stored:
                # The attempt is no longer current: it may add nothing to the run's logs.
                self.stale = True
                with self._lock:
                    self._pending.clear()
                return


class _ThreadStream:
    """sys.stdout/sys.stderr: writes from a handler's thread go to its capture, the rest
    to the stream that was there before."""

    def __init__(self, original: TextIO, name: str) -> None:
        self._original = original
        self._name = name

    def write(self, text: str) -> int:
        capture = _captures.get(threading.get_ident())
        if capture is None:
            return self._original.write(text)
        capture.write(self._name, text)
        return len(text)

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name):
        return getattr(self._original, name)


class _CaptureHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        capture = _captures.get(record.thread)
        if capture is None:
            return
        stream = "logger" if record.name.startswith("jobs.task.") else "logging"
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
        except Exception:  # noqa: BLE001 - a bad format string must not break the handler
            text = str(record.msg)
        capture.emit(
            stream, record.levelname, text if stream == "logger" else f"{record.name}: {text}"
        )


def _install() -> None:
    """Once per process: the stream proxies and the logging handler."""
    with _install_lock:
        if not isinstance(sys.stdout, _ThreadStream):
            sys.stdout = _ThreadStream(sys.stdout, "stdout")
        if not isinstance(sys.stderr, _ThreadStream):
            sys.stderr = _ThreadStream(sys.stderr, "stderr")
        root = logging.getLogger()
        if not any(isinstance(h, _CaptureHandler) for h in root.handlers):
            root.addHandler(_CaptureHandler())
        # ctx.logger's records reach the root's handlers whatever the root's level.
        logging.getLogger("jobs.task").setLevel(logging.DEBUG)
