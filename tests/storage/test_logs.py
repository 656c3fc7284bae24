"""storage.logs: the manifests' one INSERT, and two sessions sealing one attempt."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import IntegrityError, transaction

from logs_app.models import LogManifest
from storage.logs import LogManifestRow, log_manifests_insert
from tests.threads import in_thread, wait_for_lock_waiters

AT = dt.datetime(2030, 1, 1, 12, tzinfo=dt.UTC)


def _row(attempt, **overrides) -> LogManifestRow:
    values = dict(attempt_id=attempt.id, chunk_count=2, line_count=7, byte_count=300,
                  sha256="ab" * 32, dropped_lines=1, created_at=AT)  # fmt: skip
    return LogManifestRow(**(values | overrides))


@pytest.mark.django_db
def test_manifests_are_inserted_as_given_and_a_missing_time_is_the_transactions(queued_run):
    from tests.factories import running_attempt

    first, second = running_attempt(queued_run), running_attempt(queued_run)
    assert log_manifests_insert(manifests=[]) == 0
    with transaction.atomic():
        inserted = log_manifests_insert(
            manifests=[_row(first), _row(second, chunk_count=0, created_at=None)]
        )
        now = LogManifest.objects.raw("SELECT 1 AS id, NOW() AS now")[0].now
    assert inserted == 2
    stored = LogManifest.objects.get(attempt=first)
    assert (stored.chunk_count, stored.line_count, stored.byte_count, stored.sha256,
            stored.dropped_lines, stored.created_at) == (2, 7, 300, "ab" * 32, 1, AT)  # fmt: skip
    assert LogManifest.objects.get(attempt=second).created_at == now


@pytest.mark.django_db(transaction=True)
def test_a_second_session_sealing_the_same_attempt_waits_then_fails(queued_run):
    from tests.factories import running_attempt

    attempt = running_attempt(queued_run)
    errors: list[BaseException] = []
    inserted = threading.Event()
    release = threading.Event()

    def first() -> None:
        with transaction.atomic():
            log_manifests_insert(manifests=[_row(attempt)])
            inserted.set()
            release.wait(30)

    def second() -> None:
        inserted.wait(30)
        log_manifests_insert(manifests=[_row(attempt, chunk_count=9)])

    threads = [in_thread(first), in_thread(second, errors)]
    wait_for_lock_waiters(1)  # the second waits on the first's uncommitted unique key
    release.set()
    for thread in threads:
        thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], IntegrityError)
    assert LogManifest.objects.get(attempt=attempt).chunk_count == 2
