"""Retention of run logs, with a pinned clock: chunks (rows and stored content) and manifests
of attempts finished before the cutoff go; recent and running attempts' logs stay."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.files.storage import storages
from django.core.management import call_command

from dispatch.pruner import PrunerConfig, pruner_run_once
from jobs.clock import db_now
from jobs.models import Attempt
from logs_app.models import LogChunk, LogManifest
from logs_app.retention import logs_prune
from tests.logs.test_api import NOW, running_attempt, ship, succeed

INLINE_MAX = 16 * 1024


def attempt_with_logs(queued_run, *, finished: dt.datetime | None) -> Attempt:
    """An attempt with an inline chunk and one big enough for the storage; ended with its
    manifest at `finished`, or still running when None."""
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 5)
    ship(attempt, 1, 5, 300, width=100)  # ~40 KB: in the storage backend
    if finished is not None:
        succeed(attempt)
        # As if it had run then: shipped a little before it finished.
        Attempt.objects.filter(id=attempt.id).update(finished_at=finished)
        LogChunk.objects.filter(attempt=attempt).update(
            created_at=finished - dt.timedelta(minutes=1)
        )
    return attempt


def stored_names(attempt: Attempt) -> list[str]:
    return list(
        LogChunk.objects.filter(attempt=attempt)
        .exclude(storage_name="")
        .values_list("storage_name", flat=True)
    )


@pytest.mark.django_db
def test_old_finished_attempts_lose_their_logs_recent_and_running_keep_them(queued_run, settings):
    settings.SCHEDULER_LOGS = {**settings.SCHEDULER_LOGS, "retention_days": 30}
    old = attempt_with_logs(queued_run, finished=NOW - dt.timedelta(days=31))
    recent = attempt_with_logs(queued_run, finished=NOW - dt.timedelta(days=29))
    running = attempt_with_logs(queued_run, finished=None)
    (old_file,) = stored_names(old)
    assert storages["scheduler_logs"].exists(old_file)
    # However old its chunks, a running attempt's log is kept.
    LogChunk.objects.filter(attempt=running).update(created_at=NOW - dt.timedelta(days=60))

    assert logs_prune(now=NOW) == 3  # two chunks and the manifest
    assert not LogChunk.objects.filter(attempt=old).exists()
    assert not LogManifest.objects.filter(attempt=old).exists()
    assert not storages["scheduler_logs"].exists(old_file)
    for kept in (recent, running):
        assert LogChunk.objects.filter(attempt=kept).count() == 2
        assert all(storages["scheduler_logs"].exists(name) for name in stored_names(kept))
    assert LogManifest.objects.filter(attempt=recent).exists()
    assert logs_prune(now=NOW) == 0

    # A shorter retention reaches the recent one; the running one is never pruned.
    assert logs_prune(now=NOW, retention_days=1) == 3
    assert LogChunk.objects.filter(attempt=running).count() == 2


@pytest.mark.django_db
def test_pruning_is_batched_and_manifests_go_first(queued_run, api):
    old = attempt_with_logs(queued_run, finished=NOW - dt.timedelta(days=100))

    assert logs_prune(now=NOW, retention_days=30, batch_size=1) == 2  # manifest, first chunk
    # One chunk left: the log shows as incomplete, never as complete but partial.
    assert not LogManifest.objects.filter(attempt=old).exists()
    body = api.get(f"/api/v1/runs/{old.run_id}/logs/").json()
    assert body["complete"] is False and body["lines"]
    assert logs_prune(now=NOW, retention_days=30, batch_size=1) == 1  # the last chunk
    assert logs_prune(now=NOW, retention_days=30, batch_size=1) == 0


@pytest.mark.django_db
def test_the_pruner_prunes_one_batch_per_pass(queued_run, settings):
    settings.SCHEDULER_LOGS = {**settings.SCHEDULER_LOGS, "retention_days": 30}
    attempt_with_logs(queued_run, finished=NOW - dt.timedelta(days=31))
    config = PrunerConfig(batch_size=1)
    assert pruner_run_once(now=NOW, config=config).logs_pruned == 2
    assert pruner_run_once(now=NOW, config=config).logs_pruned == 1
    assert pruner_run_once(now=NOW, config=config).logs_pruned == 0


@pytest.mark.django_db
def test_the_prune_logs_command_loops_until_done(queued_run, capsys):
    now = db_now()
    old = attempt_with_logs(queued_run, finished=now - dt.timedelta(days=10))
    recent = attempt_with_logs(queued_run, finished=now - dt.timedelta(days=2))

    call_command("prune_logs", "--days", "5", "--batch-size", "1")
    assert "pruned 3" in capsys.readouterr().out
    assert not LogChunk.objects.filter(attempt=old).exists()
    assert LogChunk.objects.filter(attempt=recent).count() == 2


# Retention goes on when the storage refuses a delete with an error that is not OSError.
class DeleteDenied(Exception):
    pass


@pytest.mark.django_db(transaction=True)
def test_prune_survives_a_storage_delete_error(queued_run, monkeypatch):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 300, width=100)  # goes to storage
    succeed(attempt)
    Attempt.objects.filter(id=attempt.id).update(finished_at=NOW - dt.timedelta(days=40))
    LogChunk.objects.filter(attempt=attempt).update(created_at=NOW - dt.timedelta(days=40))
    from django.core.files.storage import storages

    storage = storages["scheduler_logs"]

    def denied(name):
        raise DeleteDenied("AccessDenied (botocore ClientError is not an OSError)")

    monkeypatch.setattr(storage, "delete", denied)
    try:
        pruned = logs_prune(now=NOW, retention_days=30)
    except DeleteDenied as exc:
        pytest.fail(f"logs_prune raised {exc!r}; no row is ever pruned while it does")
    assert pruned >= 1
