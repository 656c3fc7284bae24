"""Reads of run logs: an attempt's lines by page, its live tail, its text."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from django.db.models import Exists, F, OuterRef, Subquery, Sum
from django.db.models.functions import Coalesce

from jobs.models import Attempt, AttemptState, Run

from .models import LogChunk, LogManifest
from .store import chunk_lines

POLL_SECONDS = 0.25  # how often a waiting request looks for new lines
TEXT_CHUNKS_PER_QUERY = 20  # chunk rows (each up to the inline size) fetched at a time


def log_attempts(*, run: Run) -> list[Attempt]:
    """The run's attempts, in order, each with `complete` (its manifest exists) and
    `line_count` (lines stored so far)."""
    stored = (
        LogChunk.objects.filter(attempt=OuterRef("pk"))
        .order_by()
        .values("attempt")
        .annotate(total=Sum("line_count"))
        .values("total")
    )
    return list(
        Attempt.objects.filter(run=run)
        .order_by("number")
        .annotate(
            complete=Exists(LogManifest.objects.filter(attempt=OuterRef("pk"))),
            line_count=Coalesce(Subquery(stored), 0),
        )
    )


def log_lines(*, attempt: Attempt, after: int, limit: int) -> list[dict]:
    """At most `limit` lines numbered after `after`, in order. Only the chunks holding them
    are read: those that end past `after` and begin before the last line wanted."""
    start = after + 1
    chunks = (
        LogChunk.objects.filter(attempt=attempt, first_line__lt=start + limit)
        .alias(end=F("first_line") + F("line_count"))
        .filter(end__gt=start)
        .order_by("sequence")
    )
    lines: list[dict] = []
    for chunk in chunks:
        for line in chunk_lines(chunk):
            if line["n"] >= start:
                lines.append(line)
                if len(lines) == limit:
                    return lines
    return lines


@dataclasses.dataclass(frozen=True)
class LogPage:
    attempt: Attempt  # as read before the lines: its state, and `complete`
    lines: list[dict]
    more: bool  # lines after this page are already stored
    ended: bool  # the attempt has ended and this page holds its last line


def log_page(*, attempt_id: int, after: int, page_size: int, wait_seconds: float = 0.0) -> LogPage:
    """A page of lines after `after`. With `wait_seconds`, while there are none and the
    attempt is running, look again every `POLL_SECONDS` until some arrive, the attempt
    ends, or the wait is over."""
    deadline = time.monotonic() + wait_seconds
    while True:
        # The attempt first, then its lines: once an attempt has left `running`, no chunk
        # can be added (chunk_ship checks the state under the attempt's row lock), so the
        # lines read after seeing it ended are all it will ever have.
        attempt = Attempt.objects.annotate(
            complete=Exists(LogManifest.objects.filter(attempt=OuterRef("pk")))
        ).get(id=attempt_id)
        lines = log_lines(attempt=attempt, after=after, limit=page_size + 1)
        running = attempt.state == AttemptState.RUNNING
        if lines or not running or time.monotonic() + POLL_SECONDS > deadline:
            break
        time.sleep(POLL_SECONDS)
    more = len(lines) > page_size
    return LogPage(attempt=attempt, lines=lines[:page_size], more=more, ended=not (running or more))


def log_text(*, attempt: Attempt) -> Iterator[str]:
    """The attempt's lines as text, `ts stream level text` each, read a few chunks at a
    time so that a long log is never held in memory."""
    sequence = -1
    while True:
        chunks = list(
            LogChunk.objects.filter(attempt=attempt, sequence__gt=sequence).order_by("sequence")[
                :TEXT_CHUNKS_PER_QUERY
            ]
        )
        if not chunks:
            return
        for chunk in chunks:
            yield "".join(
                f"{line['ts']} {line['stream']} {line['level']} {line['text']}\n"
                for line in chunk_lines(chunk)
            )
        sequence = chunks[-1].sequence
