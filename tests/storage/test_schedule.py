"""storage.schedule against PostgreSQL: the materializer's one-statement write, and two
transactions writing the same occurrence at once."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
from django.db import transaction

from jobs.models import Job, OutboxMessage, OutboxState, Run, RunKind, RunState
from storage import schedule
from storage.schedule import JobAdvance, ScheduledRun, ScheduledWrite, runs_write_scheduled
from tests.factories import make_job
from tests.threads import in_thread, wait_for_lock_waiters

NOW = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)


def planned(job: Job, at: dt.datetime, state: str = RunState.QUEUED, **overrides) -> ScheduledRun:
    version = job.versions.get()
    return ScheduledRun(**{
        "id": uuid.uuid4(), "job_id": job.id, "job_version_id": version.id,
        "owner_id": job.owner_id, "state": state, "scheduled_for": at, "due_at": at,
        "idempotency_key": f"{job.id}:{at.isoformat()}", "skip_reason": "",
        "finished_at": None, "task_name": "tests.record", "queue": "jobs", "priority": 5,
        "timeout_seconds": None, **overrides,
    })  # fmt: skip


def test_the_literals_are_the_models_values():
    assert schedule.SCHEDULED == RunKind.SCHEDULED
    assert (schedule.QUEUED, schedule.SKIPPED) == (RunState.QUEUED, RunState.SKIPPED)
    assert schedule.OUTBOX_PENDING == OutboxState.PENDING
    assert (schedule.RUN, schedule.JOB, schedule.OUTBOX) == (
        Run._meta.db_table, Job._meta.db_table, OutboxMessage._meta.db_table,
    )  # fmt: skip


@pytest.mark.django_db
def test_runs_their_outbox_rows_and_the_jobs_next_occurrence_in_one_statement(user):
    job = make_job(user, now=NOW - dt.timedelta(hours=1))
    first, second = NOW - dt.timedelta(minutes=2), NOW - dt.timedelta(minutes=1)
    runs = [
        planned(job, first, timeout_seconds=30),
        planned(job, second, state=RunState.SKIPPED, skip_reason="misfire", finished_at=NOW),
        planned(job, NOW, state=RunState.PENDING, due_at=NOW + dt.timedelta(seconds=9)),
    ]
    written = runs_write_scheduled(
        runs=runs, jobs=[JobAdvance(job_id=job.id, next_run_at=NOW + dt.timedelta(hours=1))],
        now=NOW,
    )  # fmt: skip
    assert written == ScheduledWrite(created=2, skipped=1, outboxed=1)
    rows = {run.scheduled_for: run for run in Run.objects.filter(job=job)}
    assert {at: run.state for at, run in rows.items()} == {
        first: RunState.QUEUED,
        second: RunState.SKIPPED,
        NOW: RunState.PENDING,
    }
    assert rows[first].kind == RunKind.SCHEDULED and rows[first].created_at == NOW
    assert (rows[second].skip_reason, rows[second].finished_at) == ("misfire", NOW)
    assert rows[NOW].due_at == NOW + dt.timedelta(seconds=9)
    (message,) = OutboxMessage.objects.all()
    assert (message.run_id, message.owner_id, message.state, message.timeout_seconds) == (
        runs[0].id,
        job.owner_id,
        OutboxState.PENDING,
        30,
    )
    job.refresh_from_db()
    assert job.next_run_at == NOW + dt.timedelta(hours=1)


@pytest.mark.django_db
def test_an_occurrence_that_has_its_run_is_passed_over_and_the_job_still_advances(user):
    job = make_job(user, now=NOW - dt.timedelta(hours=1))
    runs_write_scheduled(runs=[planned(job, NOW)], jobs=[], now=NOW)
    again = runs_write_scheduled(
        runs=[planned(job, NOW)], jobs=[JobAdvance(job_id=job.id, next_run_at=None)], now=NOW
    )
    assert again == ScheduledWrite(created=0, skipped=0, outboxed=0)
    assert Run.objects.filter(job=job).count() == OutboxMessage.objects.count() == 1
    job.refresh_from_db()
    assert job.next_run_at is None


@pytest.mark.django_db
def test_outbox_rows_follow_the_order_of_the_runs(user):
    job = make_job(user, now=NOW - dt.timedelta(hours=1))
    instants = [NOW - dt.timedelta(seconds=n) for n in range(5)]
    runs = [planned(job, at) for at in instants]
    runs_write_scheduled(runs=runs, jobs=[], now=NOW)
    order = list(OutboxMessage.objects.order_by("id").values_list("run_id", flat=True))
    assert order == [run.id for run in runs]


@pytest.mark.django_db(transaction=True)
def test_two_transactions_writing_one_occurrence_create_one_run(user):
    """The second write waits on the first's uncommitted run (the one-per-occurrence
    index), then passes over it: one run, one outbox row, no error."""
    job = make_job(user, now=NOW - dt.timedelta(hours=1))
    written, errors = [], []
    inserted, release = threading.Event(), threading.Event()

    def first() -> None:
        with transaction.atomic():
            written.append(runs_write_scheduled(runs=[planned(job, NOW)], jobs=[], now=NOW))
            inserted.set()
            release.wait(30)

    thread = in_thread(first, errors)
    assert inserted.wait(30)
    second = in_thread(
        lambda: written.append(runs_write_scheduled(runs=[planned(job, NOW)], jobs=[], now=NOW)),
        errors,
    )
    try:
        wait_for_lock_waiters(1)
    finally:
        release.set()
        thread.join(30)
        second.join(30)
    assert errors == []
    assert sorted(written) == [ScheduledWrite(0, 0, 0), ScheduledWrite(1, 0, 1)]
    assert Run.objects.filter(job=job).count() == OutboxMessage.objects.count() == 1
