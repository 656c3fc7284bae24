"""Retention of run logs: the chunks (rows and stored content) and manifests of attempts that
finished more than `retention_days` ago. A running attempt is never pruned.

`logs_prune` does one bounded batch; the pruner (dispatch.pruner) calls it once per pass, and
`manage.py prune_logs` loops it until nothing is left. `run_logs_delete` goes with the
pruning of whole runs (jobs.retention), in its transaction.
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db.models import Exists, OuterRef

from jobs.models import AttemptState

from .models import LogChunk, LogManifest
from .store import chunks_delete


def logs_prune(
    *, now: dt.datetime, retention_days: int | None = None, batch_size: int = 1000
) -> int:
    """Delete up to `batch_size` chunks, then up to `batch_size` manifests left without
    chunks, of attempts finished before `now - retention_days`. Returns how many of both."""
    if retention_days is None:
        retention_days = settings.SCHEDULER_LOGS["retention_days"]
    cutoff = now - dt.timedelta(days=retention_days)
    expired = {"attempt__finished_at__lt": cutoff}
    running = {"attempt__state": AttemptState.RUNNING}
    # A chunk is stored before its attempt finishes, so `created_at < cutoff` holds for every
    # expired chunk (give or take a worker's clock skew, which only delays it to a later
    # pass): it lets the age index narrow the scan before the join on the attempt.
    chunks = list(
        LogChunk.objects.filter(created_at__lt=cutoff, **expired)
        .exclude(**running)
        .order_by("created_at")
        .values_list("id", "attempt_id")[:batch_size]
    )
    # The manifest goes first, with the first chunk of its attempt: a log whose chunks are
    # half deleted shows as incomplete, never as complete.
    deleted = LogManifest.objects.filter(attempt_id__in={row[1] for row in chunks}).delete()[0]
    deleted += chunks_delete(LogChunk.objects.filter(id__in=[row[0] for row in chunks]))
    # Manifests of expired attempts that had no chunks (a handler that wrote nothing).
    manifests = (
        LogManifest.objects.filter(**expired)
        .exclude(**running)
        .filter(~Exists(LogChunk.objects.filter(attempt=OuterRef("attempt"))))
        .order_by("id")
        .values_list("id", flat=True)[:batch_size]
    )
    deleted += LogManifest.objects.filter(id__in=list(manifests)).delete()[0]
    return deleted


def run_logs_delete(*, run_ids: list) -> tuple[int, list[str]]:
    """Delete the log rows (manifests, chunks) of these runs' attempts in the caller's
    transaction: (rows deleted, names of their stored content). The caller deletes the
    content (`store.stored_content_delete`) once the transaction committed, so a rollback
    never leaves a kept chunk without its content (a crash in between leaves orphan files)."""
    if not run_ids:
        return 0, []
    chunks = LogChunk.objects.filter(run_id__in=run_ids)
    names = list(chunks.exclude(storage_name="").values_list("storage_name", flat=True))
    deleted = LogManifest.objects.filter(attempt__run_id__in=run_ids).delete()[0]
    deleted += chunks.delete()[0]
    return deleted, names
