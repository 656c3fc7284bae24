"""Writing and reading log chunks: content in the `scheduler_logs` storage, rows in PostgreSQL.

A chunk row is written only while its attempt still holds its fencing token (the attempt
row is locked and checked in the chunk's transaction), so a stale attempt adds nothing.
Chunks sent again are stored once (unique per attempt and sequence).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import re

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.db import transaction

from jobs.models import Attempt, AttemptState

from .models import LogChunk, LogManifest

log = logging.getLogger("logs_app")

STORAGE_ALIAS = "scheduler_logs"
# Keys whose values are redacted before anything is stored (SPEC, "Security").
SECRET = re.compile(
    r"""(?P<key>["']?\b[\w-]*(?:password|passwd|token|secret|api[_-]?key|authorization)[\w-]*["']?)"""
    r"""(?P<sep>\s*[:=]\s*)"""
    r"""(?P<value>"[^"]*"|'[^']*'|(?:bearer|basic|token)\s+\S+|[^\s,;&'"()\[\]{}<>]+)""",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`password=hunter2` -> `password=[REDACTED]`; also JSON keys and header forms."""

    def hide(match: re.Match) -> str:
        value = match.group("value")
        quote = value[0] if value[:1] in "\"'" else ""
        return f"{match.group('key')}{match.group('sep')}{quote}[REDACTED]{quote}"

    return SECRET.sub(hide, text)


@dataclasses.dataclass
class Chunk:
    sequence: int
    first_line: int
    lines: list[dict]  # {"n", "ts", "stream", "level", "text"}
    size: int = 0  # bytes held in memory, for the capture's bound

    def encode(self) -> bytes:
        return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in self.lines).encode()


def _storage_name(attempt: Attempt, sequence: int) -> str:
    return f"runs/{attempt.run_id}/{attempt.number}-{attempt.fencing_token}/{sequence:06d}.ndjson"


def _place(attempt: Attempt, chunk: Chunk, data: bytes) -> tuple[str, str]:
    """(inline content, storage name): small chunks, and any chunk the storage cannot take
    right now, stay inline in the row, so that storing never fails for want of storage."""
    if len(data) <= settings.SCHEDULER_LOGS["inline_max_bytes"]:
        return data.decode(), ""
    storage = storages[STORAGE_ALIAS]
    name = _storage_name(attempt, chunk.sequence)
    try:
        if storage.exists(name):  # a re-send: same sequence, same content
            storage.delete(name)
        return "", storage.save(name, ContentFile(data))
    except Exception as exc:  # noqa: BLE001 - any backend's failure (boto3's are not OSError)
        log.warning("log storage unavailable, keeping chunk inline: %r", exc)
        return data.decode(), ""


def _insert(attempt: Attempt, chunk: Chunk, now: dt.datetime) -> None:
    if LogChunk.objects.filter(attempt=attempt, sequence=chunk.sequence).exists():
        return  # a re-send of a chunk already stored: nothing to place again
    data = chunk.encode()
    content, name = _place(attempt, chunk, data)
    LogChunk.objects.get_or_create(
        attempt=attempt,
        sequence=chunk.sequence,
        defaults={
            "run_id": attempt.run_id,
            "first_line": chunk.first_line,
            "line_count": len(chunk.lines),
            "byte_count": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "content": content,
            "storage_name": name,
            "created_at": now,
        },
    )


def chunk_ship(*, attempt: Attempt, chunk: Chunk, now: dt.datetime) -> bool:
    """Store one chunk while the attempt is current; False (nothing stored) once it is not."""
    with transaction.atomic():
        current = (
            Attempt.objects.select_for_update()
            .filter(id=attempt.id, state=AttemptState.RUNNING, fencing_token=attempt.fencing_token)
            .exists()
        )
        if not current:
            return False
        _insert(attempt, chunk, now)
    return True


def logs_seal(
    *, attempt: Attempt, chunks: list[Chunk], dropped_lines: int, now: dt.datetime
) -> None:
    """Store the last chunks and the manifest. Call inside the transaction that ends the
    attempt, after its conditional update won: all of it commits together, or none."""
    for chunk in chunks:
        _insert(attempt, chunk, now)
    rows = list(
        LogChunk.objects.filter(attempt=attempt)
        .order_by("sequence")
        .values_list("sha256", "line_count", "byte_count")
    )
    LogManifest.objects.create(
        attempt=attempt,
        chunk_count=len(rows),
        line_count=sum(row[1] for row in rows),
        byte_count=sum(row[2] for row in rows),
        sha256=hashlib.sha256("".join(row[0] for row in rows).encode()).hexdigest(),
        dropped_lines=dropped_lines,
        created_at=now,
    )


def chunk_lines(chunk: LogChunk) -> list[dict]:
    """The chunk's lines, from the row or from the storage."""
    if chunk.storage_name:
        with storages[STORAGE_ALIAS].open(chunk.storage_name, "rb") as handle:
            text = handle.read().decode()
    else:
        text = chunk.content
    return [json.loads(line) for line in text.splitlines() if line]


def chunks_delete(chunks) -> int:
    """Delete chunk rows and their stored content (retention)."""
    storage = storages[STORAGE_ALIAS]
    rows = list(chunks.values_list("id", "storage_name"))
    for _, name in rows:
        if name:
            try:
                storage.delete(name)
            except OSError:
                log.warning("could not delete stored log content %s", name, exc_info=True)
    LogChunk.objects.filter(id__in=[row[0] for row in rows]).delete()
    return len(rows)
