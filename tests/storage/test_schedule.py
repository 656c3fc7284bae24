"""storage.schedule against PostgreSQL: the claim of due jobs (two claims at once, a
partition scope, its plan) and the materializer's one-statement write (two transactions
writing the same occurrence at once)."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
from django.db import connection, transaction

from jobs.models import (
    Job,
    JobState,
    OutboxMessage,
    OutboxState,
    PartitionLease,
    Run,
    RunKind,
    RunState,
)
from jobs.partitions import job_partition
from storage import schedule
from storage.schedule import (
    DueJob,
    JobAdvance,
    ScheduledRun,
    ScheduledWrite,
    jobs_due_claim,
    runs_write_scheduled,
)
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


def due_jobs(user, count: int) -> list[Job]:
    """`count` active jobs due a minute apart, the oldest first."""
    jobs = [make_job(user, now=NOW - dt.timedelta(hours=1), name=f"due {n}") for n in range(count)]
    for n, job in enumerate(jobs):
        Job.objects.filter(id=job.id).update(next_run_at=NOW - dt.timedelta(minutes=count - n))
    return jobs


def test_the_literals_are_the_models_values():
    assert schedule.ACTIVE == JobState.ACTIVE
    assert schedule.JOB_VERSION == Job.versions.field.model._meta.db_table
    assert schedule.SCHEDULED == RunKind.SCHEDULED
    assert (schedule.QUEUED, schedule.SKIPPED) == (RunState.QUEUED, RunState.SKIPPED)
    assert (schedule.RUN, schedule.JOB) == (Run._meta.db_table, Job._meta.db_table)


@pytest.mark.django_db
def test_the_claim_reads_due_active_jobs_with_their_current_spec_in_due_order(user):
    jobs = due_jobs(user, 3)
    Job.objects.filter(id=jobs[0].id).update(state=JobState.PAUSED)
    Job.objects.filter(id=jobs[2].id).update(next_run_at=NOW + dt.timedelta(seconds=1))
    (claimed,) = jobs_due_claim(now=NOW, limit=10)
    job = Job.objects.get(id=jobs[1].id)
    version = job.versions.get(version=job.version)
    assert claimed == DueJob(job.id, JobState.ACTIVE, version.id, version.spec, job.next_run_at,
                             job.created_at, job.resumed_at, job.owner_id)  # fmt: skip
    assert isinstance(claimed.spec, dict)
    assert [row.id for row in jobs_due_claim(now=NOW + dt.timedelta(seconds=1), limit=1)] == [
        jobs[1].id
    ]


@pytest.mark.django_db
def test_a_scoped_claim_takes_only_the_jobs_of_partitions_its_holder_holds_now(user):
    jobs = due_jobs(user, 8)
    mine = {job_partition(job.id, 4) for job in jobs[:2]}
    for partition in mine:
        PartitionLease.objects.create(partition=partition, holder="me", acquired_at=NOW,
                                      expires_at=NOW + dt.timedelta(days=36500))  # fmt: skip
    PartitionLease.objects.create(
        partition=next(iter({0, 1, 2, 3} - mine)),
        holder="me",
        acquired_at=NOW,
        expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC),  # expired on the database's clock
    )
    claimed = {row.id for row in jobs_due_claim(now=NOW, limit=10, holder="me", partitions=4)}
    assert claimed == {job.id for job in jobs if job_partition(job.id, 4) in mine}
    assert jobs_due_claim(now=NOW, limit=10, holder="nobody", partitions=4) == []


@pytest.mark.django_db
def test_the_claim_walks_the_due_jobs_index_scoped_or_not(user, monkeypatch):
    due_jobs(user, 3)
    statements = []
    monkeypatch.setattr(schedule, "fetch_all", lambda *call: statements.append(call) or [])
    jobs_due_claim(now=NOW, limit=500)
    jobs_due_claim(now=NOW, limit=500, holder="me", partitions=4)
    monkeypatch.undo()
    for sql, params in statements:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")  # tiny tables favour a scan
            cursor.execute("EXPLAIN " + sql, params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "job_due_idx" in plan, plan


@pytest.mark.django_db(transaction=True)
def test_two_claims_at_once_take_different_jobs(user):
    """A pass's claim holds its jobs until it commits: another replica's claim passes them
    over (SKIP LOCKED) instead of waiting, and takes the next due ones."""
    jobs = due_jobs(user, 4)
    claimed, release = threading.Event(), threading.Event()
    first: list = []

    def hold() -> None:
        with transaction.atomic():
            first.extend(row.id for row in jobs_due_claim(now=NOW, limit=2))
            claimed.set()
            release.wait(30)

    thread = in_thread(hold)
    assert claimed.wait(30)
    try:
        with transaction.atomic():
            second = [row.id for row in jobs_due_claim(now=NOW, limit=10)]
    finally:
        release.set()
        thread.join(30)
    assert sorted(first) == sorted([jobs[0].id, jobs[1].id])  # the outer read is unordered
    assert sorted(second) == sorted([jobs[2].id, jobs[3].id])


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
def test_the_write_works_on_the_prepared_statements_generic_plan(user):
    """The statement is prepared once per connection; after a few executions PostgreSQL
    may plan it once for every parameter value: its ON CONFLICT must still find the
    one-per-occurrence index (a partial index, whose predicate a parameter cannot prove)."""
    job = make_job(user, now=NOW - dt.timedelta(hours=1))
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
    try:
        for minute in range(3):
            at = NOW + dt.timedelta(minutes=minute)
            written = runs_write_scheduled(
                runs=[planned(job, at)], jobs=[JobAdvance(job_id=job.id, next_run_at=None)],
                now=NOW,
            )  # fmt: skip
            assert written == ScheduledWrite(created=1, skipped=0, outboxed=1)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET plan_cache_mode")


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
