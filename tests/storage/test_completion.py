"""storage.completion: job completion's one rule (`scheduler_job_complete_if_finished`),
called by the trigger in the statement that ends a run and by the completer's safety net
(`jobs_complete_if_finished`), against PostgreSQL, races included."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time

import pytest
from django.db import transaction

from jobs.models import AuditEvent, Job, JobState, Run, RunState
from storage.completion import jobs_complete_if_finished
from tests.factories import PINNED_NOW, make_job
from tests.threads import in_thread, wait_for_lock_waiters

NOW = PINNED_NOW + dt.timedelta(minutes=5)


def awaiting(user, name: str = "done") -> Job:
    """A job whose schedule is over and that has no run (as a job past its end_at)."""
    job = make_job(user, now=PINNED_NOW, name=name)
    Job.objects.filter(id=job.id).update(next_run_at=None)
    return job


def completions(job: Job) -> int:
    return AuditEvent.objects.filter(job=job, action="job.completed").count()


@pytest.mark.django_db
def test_a_finished_job_is_completed_once_with_its_audit_event(user):
    first, second = awaiting(user, "first"), awaiting(user, "second")
    assert jobs_complete_if_finished(job_ids=[second.id, first.id], now=NOW) == [
        second.id,
        first.id,
    ]
    job = Job.objects.get(id=first.id)
    assert (job.state, job.updated_at) == (JobState.COMPLETED, NOW)
    event = AuditEvent.objects.get(job=first, action="job.completed")
    assert (event.actor_label, event.created_at, event.data) == ("system:scheduler", NOW, {})
    # Completed: nothing left to do.
    assert jobs_complete_if_finished(job_ids=[first.id], now=NOW) == []
    assert completions(first) == 1
    assert jobs_complete_if_finished(job_ids=[], now=NOW) == []


@pytest.mark.django_db
def test_a_job_still_scheduled_paused_deleted_or_running_is_not_completed(user, queued_run):
    hourly = {"kind": "interval", "every_seconds": 3600}
    scheduled = make_job(user, now=PINNED_NOW, name="hourly", schedule=hourly)
    paused, deleted = awaiting(user, "paused"), awaiting(user, "deleted")
    Job.objects.filter(id=paused.id).update(state=JobState.PAUSED)
    Job.objects.filter(id=deleted.id).update(deleted_at=NOW)
    running = queued_run().job  # its schedule is over, its run queued
    ids = [scheduled.id, paused.id, deleted.id, running.id]
    assert jobs_complete_if_finished(job_ids=ids, now=NOW) == []
    assert not AuditEvent.objects.filter(action="job.completed").exists()
    assert Job.objects.get(id=running.id).state == JobState.ACTIVE


@pytest.mark.django_db
def test_the_statement_that_ends_a_jobs_last_active_run_completes_it(queued_run):
    run = queued_run()
    job = run.job
    Run.objects.filter(id=run.id).update(state=RunState.CANCELLED)  # the trigger's rule
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED
    assert completions(job) == 1
    # A run that was not active ending again changes nothing.
    Run.objects.filter(id=run.id).update(state=RunState.SKIPPED)
    assert completions(job) == 1


@pytest.mark.django_db
def test_a_run_ending_beside_another_active_run_leaves_the_job_to_that_one(queued_run, user):
    from jobs.services import job_trigger

    run = queued_run()
    manual = job_trigger(job=run.job, actor=user, now=NOW)
    Run.objects.filter(id=run.id).update(state=RunState.CANCELLED)
    assert Job.objects.get(id=run.job_id).state == JobState.ACTIVE
    Run.objects.filter(id=manual.id).update(state=RunState.FAILED)
    assert Job.objects.get(id=run.job_id).state == JobState.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_row_another_transaction_holds_is_skipped_not_waited_for(user):
    """SKIP LOCKED: a trigger or a backfill holding the job is about to add a run; the
    safety net leaves the job to a later pass instead of waiting."""
    job = awaiting(user)
    holding, release, errors = threading.Event(), threading.Event(), []

    def hold() -> None:
        with transaction.atomic():
            Job.objects.select_for_update().get(id=job.id)
            holding.set()
            release.wait(10)

    holder = in_thread(hold, errors)
    assert holding.wait(5)
    started = time.monotonic()
    with transaction.atomic():
        assert jobs_complete_if_finished(job_ids=[job.id], now=NOW) == []
    assert time.monotonic() - started < 2
    release.set()
    holder.join(10)
    assert errors == []
    assert jobs_complete_if_finished(job_ids=[job.id], now=NOW) == [job.id]
    assert completions(job) == 1


@pytest.mark.django_db(transaction=True)
def test_two_completers_racing_on_one_job_complete_it_once(user):
    """Two connections call the rule for the same job: the first takes the row and
    completes it; the second, while the first has not committed, skips the row; after it
    did, finds the job completed. One completion, one audit event."""
    job = awaiting(user)
    completed, commit, errors, results = threading.Event(), threading.Event(), [], {}

    def first() -> None:
        with transaction.atomic():
            results["first"] = jobs_complete_if_finished(job_ids=[job.id], now=NOW)
            completed.set()
            commit.wait(10)

    thread = in_thread(first, errors)
    assert completed.wait(5)
    with transaction.atomic():
        results["second, meanwhile"] = jobs_complete_if_finished(job_ids=[job.id], now=NOW)
    commit.set()
    thread.join(10)
    results["second, after"] = jobs_complete_if_finished(job_ids=[job.id], now=NOW)
    assert errors == []
    assert results == {"first": [job.id], "second, meanwhile": [], "second, after": []}
    assert completions(job) == 1


@pytest.mark.django_db(transaction=True)
def test_a_run_committed_while_the_ending_statement_waited_keeps_the_job_active(queued_run):
    """The statement that ends a job's last active run takes its snapshot, then waits on
    the run's row; meanwhile another session commits a new active run of the job. The rule
    reads the job's runs after the job's lock, in a statement of its own: it sees that run
    and leaves the job active (judged on the ending statement's snapshot, it would have
    completed a job with a run still to go)."""
    import uuid

    first = queued_run()
    job = first.job
    second = Run.objects.get(id=first.id)
    second.id, second.kind, second.state = uuid.uuid4(), "manual", RunState.CANCELLED
    second.idempotency_key = f"{first.idempotency_key}:second"
    second.save(force_insert=True)  # a run of the job that ended: replayed below
    holding, release = threading.Event(), threading.Event()
    errors: list = []

    def hold_the_first_run() -> None:
        with transaction.atomic():
            list(Run.objects.select_for_update().filter(id=first.id))
            holding.set()
            release.wait(20)

    def end_the_first_run() -> None:  # the worker's success: the trigger applies the rule
        Run.objects.filter(id=first.id).update(state=RunState.SUCCEEDED)

    threads = [in_thread(hold_the_first_run, errors)]
    try:
        assert holding.wait(10)
        threads.append(in_thread(end_the_first_run, errors))
        wait_for_lock_waiters(1)
        # Another session queues the second run again (as a replay does) and commits.
        Run.objects.filter(id=second.id).update(state=RunState.QUEUED)
    finally:
        release.set()
        for thread in threads:
            thread.join(20)
    assert errors == []
    assert Run.objects.get(id=first.id).state == RunState.SUCCEEDED
    assert Job.objects.get(id=job.id).state == JobState.ACTIVE
    assert completions(job) == 0


@pytest.mark.django_db
def test_the_completion_never_walks_the_due_index_under_the_generic_plan(user):
    """The rule's job lock, as the installed function runs it (a generic plan, cached for
    the connection's life), never walks job_due_idx, which cannot serve its
    `next_run_at IS NULL`. When job_due_idx held the jobs awaiting completion
    too, a connection that planned the lock on a table that never had a row walked it
    through all of them: a burst of N one-time jobs cost N² index reads to complete."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_indexdef('job_due_idx'::regclass)")
        assert "next_run_at IS NOT NULL" in cursor.fetchone()[0]
        cursor.execute(
            "SELECT pg_get_functiondef('scheduler_job_complete_if_finished(uuid, timestamptz)'"
            "::regprocedure)"
        )
        (body,) = cursor.fetchone()
        lock = re.search(r"PERFORM (1 FROM jobs_job.*?SKIP LOCKED);", body, re.S).group(1)
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE job_lock(uuid) AS SELECT {lock.replace('p_job_id', '$1')}")
        try:
            cursor.execute("EXPLAIN EXECUTE job_lock('00000000-0000-0000-0000-000000000000')")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("DEALLOCATE job_lock")
    # A primary key probe, or a scan of a table this small; never the walk.
    assert "job_due_idx" not in plan, plan
