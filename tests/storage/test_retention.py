"""storage.retention against PostgreSQL: the claim of expired runs (and two pruners
claiming at once) and the deletion of terminal runs with every row that refers to them."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.apps import apps
from django.db import connection, transaction

from jobs.models import (
    ActiveRun,
    Attempt,
    AuditEvent,
    DependencyGate,
    Effect,
    Job,
    JobState,
    OutboxMessage,
    Run,
    RunState,
)
from jobs.services import job_trigger
from jobs.transitions import TERMINAL_RUN_STATES
from storage import retention
from storage.retention import runs_delete_terminal, runs_expired_claim
from tests.threads import in_thread

NOW = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)


def finished(job: Job, user, end: dt.datetime, state: str = RunState.SUCCEEDED) -> Run:
    run = job_trigger(job=job, actor=user, now=end - dt.timedelta(minutes=1))
    Run.objects.filter(id=run.id).update(state=state, finished_at=end)
    return run


@pytest.fixture
def job(make_job):
    return make_job(now=NOW - 60 * DAY)


def complete(job: Job) -> None:
    """A job that will not run again: none of its runs is kept for its policies."""
    Job.objects.filter(id=job.id).update(state=JobState.COMPLETED)


def test_the_literals_are_the_models_values():
    terminal = ", ".join(f"'{state}'" for state in sorted(TERMINAL_RUN_STATES))
    assert retention.TERMINAL == f"({terminal})"
    assert retention.MAY_RUN_AGAIN == f"('{JobState.ACTIVE}', '{JobState.PAUSED}')"
    assert {table for table, _ in retention.RUN_ROWS} == {
        model._meta.db_table
        for model in (ActiveRun, Effect, OutboxMessage, AuditEvent, Attempt, Run, DependencyGate)
    }
    # Every table of the domain with a foreign key to a run or an attempt is among them (a
    # run logs_app keeps is deleted by logs_app first): a new one would fail the deletion.
    referring = {
        model._meta.db_table
        for model in apps.get_app_config("jobs").get_models()
        for field in model._meta.get_fields()
        if getattr(field, "many_to_one", False) and field.concrete
        and field.related_model in (Run, Attempt)
    }  # fmt: skip
    assert referring <= {table for table, _ in retention.RUN_ROWS}


@pytest.mark.django_db
def test_the_claim_takes_terminal_runs_finished_before_the_cutoff_oldest_first(job, user):
    oldest = finished(job, user, NOW - 40 * DAY, RunState.FAILED)
    older = finished(job, user, NOW - 35 * DAY, RunState.CANCELLED)
    finished(job, user, NOW - 10 * DAY)  # within retention
    waiting = job_trigger(job=job, actor=user, now=NOW - 50 * DAY)  # queued
    complete(job)
    assert runs_expired_claim(cutoff=NOW - 30 * DAY, limit=10) == [oldest.id, older.id]
    assert runs_expired_claim(cutoff=NOW - 30 * DAY, limit=1) == [oldest.id]
    assert waiting.id not in runs_expired_claim(cutoff=NOW, limit=10)


@pytest.mark.django_db
def test_the_claim_keeps_what_a_job_that_may_run_again_needs(make_job, user):
    job = make_job(now=NOW - 60 * DAY)  # active, pause_after_failures unset: keeps 1
    old = finished(job, user, NOW - 40 * DAY)
    newest = finished(job, user, NOW - 35 * DAY)
    assert runs_expired_claim(cutoff=NOW - 30 * DAY, limit=10) == [old.id]
    assert newest.id not in runs_expired_claim(cutoff=NOW, limit=10)


@pytest.mark.django_db(transaction=True)
def test_two_claims_at_once_take_different_runs(job, user):
    """A pruner's claim holds its runs until it commits: another pruner's claim passes
    them over (SKIP LOCKED) instead of waiting, and takes the others."""
    runs = [finished(job, user, NOW - (40 - n) * DAY) for n in range(4)]
    complete(job)
    claimed, release = threading.Event(), threading.Event()
    first: list = []

    def hold() -> None:
        with transaction.atomic():
            first.extend(runs_expired_claim(cutoff=NOW - 30 * DAY, limit=2))
            claimed.set()
            release.wait(30)

    thread = in_thread(hold)
    assert claimed.wait(30)
    try:
        with transaction.atomic():
            second = runs_expired_claim(cutoff=NOW - 30 * DAY, limit=10)
    finally:
        release.set()
        thread.join(30)
    assert first == [runs[0].id, runs[1].id]
    assert second == [runs[2].id, runs[3].id]


@pytest.mark.django_db
def test_terminal_runs_go_with_every_row_that_refers_to_them(job, user):
    failed = finished(job, user, NOW - 40 * DAY, RunState.FAILED)
    done = finished(job, user, NOW - 40 * DAY)
    queued = job_trigger(job=job, actor=user, now=NOW)
    for run in (failed, done, queued):
        Effect.objects.create(run_id=run.id, name="charge", attempt_number=1, fencing_token=1)
        AuditEvent.objects.create(actor_label="system:test", action="run.x", run_id=run.id)
    triggered = AuditEvent.objects.create(actor_label="user", action="job.triggered",
                                          job_id=job.id, run_id=done.id)  # fmt: skip
    doomed = [failed.id, done.id]
    rows = len(doomed) + sum(
        model.objects.filter(run_id__in=doomed).count()
        for model in (ActiveRun, Effect, OutboxMessage, Attempt)
    )
    rows += AuditEvent.objects.filter(run_id__in=doomed).exclude(action__startswith="job.").count()
    deleted = runs_delete_terminal(run_ids=[*doomed, queued.id])
    assert deleted == rows
    assert set(Run.objects.values_list("id", flat=True)) == {queued.id}
    assert not Effect.objects.exclude(run_id=queued.id).exists()
    assert not OutboxMessage.objects.exclude(run_id=queued.id).exists()
    assert not AuditEvent.objects.filter(action="run.x").exclude(run_id=queued.id).exists()
    triggered.refresh_from_db()
    assert triggered.run_id is None  # the job's history stays, unlinked


@pytest.mark.django_db
def test_a_run_a_dependency_gate_decided_goes_with_its_gate(job, user):
    done = finished(job, user, NOW - 40 * DAY)
    DependencyGate.objects.create(job=job, scheduled_for=done.scheduled_for, kind=done.kind,
                                  state="decided", missing=0, created_at=NOW - 40 * DAY,
                                  run=done)  # fmt: skip
    runs_delete_terminal(run_ids=[done.id])
    with connection.cursor() as cursor:  # the foreign keys checked now, not at rollback
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    assert not DependencyGate.objects.exists()


@pytest.mark.django_db
def test_no_ids_or_no_terminal_run_deletes_nothing(job, user):
    queued = job_trigger(job=job, actor=user, now=NOW)
    assert runs_delete_terminal(run_ids=[]) == 0
    assert runs_delete_terminal(run_ids=[queued.id]) == 0
    assert Run.objects.filter(id=queued.id).exists()
