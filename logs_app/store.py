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

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.db import transaction

from jobs.models import Attempt, AttemptState
from jobs.redaction import redact
from storage.logs import LogManifestRow, log_manifests_insert

from .models import LogChunk, LogManifest

log = logging.getLogger("logs_app")

STORAGE_ALIAS = "scheduler_logs"
MAX_LINE_CHARS = 16 * 1024  # a longer line is cut, with a marker


def clean_line(text: str) -> str:
    """What is stored of one line: valid UTF-8 (lone surrogates escaped), bounded in
    length, and with secret-looking values redacted."""
    if len(text) > MAX_LINE_CHARS:
        text = f"{text[:MAX_LINE_CHARS]}... [line cut at {MAX_LINE_CHARS} characters]"
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return redact(text)


@dataclasses.dataclass
class Chunk:
    sequence: int
    first_line: int
    lines: list[bytes]  # each an encoded JSON object and its newline
    size: int = 0  # bytes held in memory, for the capture's bound

    def encode(self) -> bytes:
        return b"".join(self.lines)


def encode_line(n: int, ts: str, stream: str, level: str, text: str) -> bytes:
    return (
        json.dumps(
            {"n": n, "ts": ts, "stream": stream, "level": level, "text": text}, ensure_ascii=False
        )
        + "\n"
    ).encode()


@dataclasses.dataclass
class PlacedChunk:
    """A chunk whose content is already where it will live: ready for its row."""

    chunk: Chunk
    byte_count: int
    sha256: str
    content: str
    storage_name: str


def _storage_name(attempt: Attempt, sequence: int) -> str:
    return f"runs/{attempt.run_id}/{attempt.number}-{attempt.fencing_token}/{sequence:06d}.ndjson"


def chunk_place(*, attempt: Attempt, chunk: Chunk) -> PlacedChunk:
    """Put the content where it will live, before (and outside) any transaction: small
    chunks, and any chunk the storage cannot take right now, stay inline in the row, so
    that storing never fails for want of storage."""
    data = chunk.encode()
    placed = PlacedChunk(chunk, len(data), hashlib.sha256(data).hexdigest(), data.decode(), "")
    if len(data) <= settings.SCHEDULER_LOGS["inline_max_bytes"]:
        return placed
    name = _storage_name(attempt, chunk.sequence)
    try:
        storage = storages[STORAGE_ALIAS]
        if storage.exists(name):  # a re-send: same sequence, same content
            storage.delete(name)
        saved = storage.save(name, ContentFile(data))
    except Exception as exc:  # noqa: BLE001 - any backend's failure (boto3's are not OSError)
        log.warning("log storage unavailable, keeping chunk inline: %r", exc)
        return placed
    return dataclasses.replace(placed, content="", storage_name=saved)


def _unplace(placed: list[PlacedChunk]) -> None:
    """Remove stored content whose row was not written (refused, or rolled back)."""
    for item in placed:
        if item.storage_name:
            try:
                storages[STORAGE_ALIAS].delete(item.storage_name)
            except Exception:  # noqa: BLE001 - retention's lifecycle rules are the backstop
                log.warning("could not remove unused log content %s", item.storage_name)


def _row(attempt: Attempt, placed: PlacedChunk, now) -> LogChunk:
    return LogChunk(
        attempt=attempt,
        run_id=attempt.run_id,
        sequence=placed.chunk.sequence,
        first_line=placed.chunk.first_line,
        line_count=len(placed.chunk.lines),
        byte_count=placed.byte_count,
        sha256=placed.sha256,
        content=placed.content,
        storage_name=placed.storage_name,
        created_at=now,
    )


def _insert(attempt: Attempt, placed: PlacedChunk, now: dt.datetime) -> bool:
    """The chunk's row; False when one was stored already (a re-send)."""
    row = _row(attempt, placed, now)
    fields = {
        f.name: getattr(row, f.name) for f in LogChunk._meta.concrete_fields if not f.primary_key
    }
    _, created = LogChunk.objects.get_or_create(
        attempt=attempt, sequence=placed.chunk.sequence, defaults=fields
    )
    return created


def chunk_ship(*, attempt: Attempt, chunk: Chunk, now: dt.datetime) -> bool:
    """Store one chunk while the attempt is current; False (nothing stored) once it is not.

    The content is placed first; the transaction only locks the attempt row, checks its
    state and token, and inserts the row, so a slow storage never holds the lock."""
    placed = chunk_place(attempt=attempt, chunk=chunk)
    try:
        with transaction.atomic():
            current = (
                Attempt.objects.select_for_update()
                .filter(
                    id=attempt.id, state=AttemptState.RUNNING, fencing_token=attempt.fencing_token
                )
                .exists()
            )
            created = current and _insert(attempt, placed, now)
    except BaseException:
        _unplace([placed])
        raise
    if not created:
        _unplace([placed])
    return current


def logs_prepare(*, attempt: Attempt, chunks: list[Chunk]) -> list[PlacedChunk]:
    """Place the last chunks' content, before the transaction that ends the attempt."""
    return [chunk_place(attempt=attempt, chunk=chunk) for chunk in chunks]


def logs_discard(placed: list[PlacedChunk]) -> None:
    """The outcome was refused (a stale attempt): its last chunks are not kept."""
    _unplace(placed)


def logs_seal(
    *,
    attempt: Attempt,
    placed: list[PlacedChunk],
    dropped_lines: int,
    now,
    shipped: bool = True,
) -> None:
    """Store the last chunks' rows and the manifest. Call inside the transaction that ends
    the attempt, after its conditional update won: all of it commits together, or none.
    `shipped`: whether chunks were stored while the attempt ran (False: `placed` is all)."""
    logs_seal_many(
        [(attempt, {"placed": placed, "dropped_lines": dropped_lines, "shipped": shipped})],
        now=now,
    )


def logs_manifests_alone(sealed: list[tuple[Attempt, dict]]) -> list[LogManifestRow] | None:
    """The manifests of attempts whose logs have no chunk to store or read back (nothing
    placed, nothing shipped as they ran: a handler that logged nothing), for the success's
    own statement to insert (created at the transaction's time); None when some attempt
    has chunks (`logs_seal_many` then)."""
    if any(logs["placed"] or logs["shipped"] for _, logs in sealed):
        return None
    empty = hashlib.sha256(b"").hexdigest()
    return [
        LogManifestRow(attempt_id=attempt.id, chunk_count=0, line_count=0, byte_count=0,
                       sha256=empty, dropped_lines=logs["dropped_lines"], created_at=None)
        for attempt, logs in sealed
    ]  # fmt: skip


def logs_seal_many(sealed: list[tuple[Attempt, dict]], *, now) -> None:
    """`logs_seal` for several attempts ended in one transaction (the runs of a packed
    message), each with its `placed`, `dropped_lines` and `shipped`: two statements for
    all of them, and one more read for each attempt whose chunks were shipped as it ran."""
    # One statement; a chunk the shipper stored already (a re-send) is kept as it is.
    LogChunk.objects.bulk_create(
        [_row(attempt, item, now) for attempt, logs in sealed for item in logs["placed"]],
        ignore_conflicts=True,
    )
    manifests: list[LogManifest] = []
    for attempt, logs in sealed:
        if logs["shipped"]:
            rows = list(
                LogChunk.objects.filter(attempt=attempt)
                .order_by("sequence")
                .values_list("sha256", "line_count", "byte_count")
            )
        else:  # every chunk is in `placed`: no need to read them back
            rows = [
                (item.sha256, len(item.chunk.lines), item.byte_count) for item in logs["placed"]
            ]
        manifests.append(
            LogManifest(
                attempt=attempt,
                chunk_count=len(rows),
                line_count=sum(row[1] for row in rows),
                byte_count=sum(row[2] for row in rows),
                sha256=hashlib.sha256("".join(row[0] for row in rows).encode()).hexdigest(),
                dropped_lines=logs["dropped_lines"],
                created_at=now,
            )
        )
    _manifests_insert(manifests)


def _manifests_insert(manifests: list[LogManifest]) -> None:
    """One INSERT of all the manifests (storage.logs); a `created_at` given as an
    expression, such as Now(), is the transaction's time."""
    log_manifests_insert(
        manifests=[
            LogManifestRow(
                attempt_id=m.attempt_id, chunk_count=m.chunk_count, line_count=m.line_count,
                byte_count=m.byte_count, sha256=m.sha256, dropped_lines=m.dropped_lines,
                created_at=m.created_at if isinstance(m.created_at, dt.datetime) else None,
            )
            for m in manifests
        ]
    )  # fmt: skip


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
    rows = list(chunks.values_list("id", "storage_name"))
    stored_content_delete([name for _, name in rows if name])
    LogChunk.objects.filter(id__in=[row[0] for row in rows]).delete()
    return len(rows)


def stored_content_delete(names: list[str]) -> None:
    """Delete chunks' content from the storage; a failure is logged, never raised (the row
    is gone or going: the content is only an orphan file then)."""
    storage = storages[STORAGE_ALIAS]
    for name in names:
        try:
            storage.delete(name)
        except Exception:  # noqa: BLE001 - any backend's failure; see docs/logs.md
            log.warning("could not delete stored log content %s", name, exc_info=True)
