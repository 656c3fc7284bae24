"""Lifecycle services called directly: each refuses what its state forbids and writes
nothing then; the backfill constraint is the backstop behind the job's row lock."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import IntegrityError, transaction

from jobs.keys import backfill_key
from jobs.models import AuditEvent, Job, JobState, JobVersion, OutboxMessage, Run, RunKind, RunState
from jobs.services import (
    job_backfill,
    job_cancel,
    job_delete,
    job_trigger,
    job_update,
    spec_diff,
)

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}


def test_update_with_a_stale_version_writes_nothing(make_job, user):
    job = make_job(now=NOW, schedule=HOURLY)
    assert job_update(
        job=job, spec=job.spec | {"name": "a"}, expected_version=1, actor=user, now=NOW
    )
    assert not job_update(
        job=job, spec=job.spec | {"name": "b"}, expected_version=1, actor=user, now=NOW
    )
    job.refresh_from_db()
    assert (job.version, job.name) == (2, "a")
    assert JobVersion.objects.filter(job=job).count() == 2
    assert AuditEvent.objects.filter(job=job, action="job.updated").count() == 1


def test_update_of_a_cancelled_job_is_refused(make_job, user):
    job = make_job(now=NOW, schedule=HOURLY)
    job_cancel(job=job, actor=user, now=NOW)
    assert not job_update(
        job=job, spec=job.spec | {"name": "a"}, expected_version=1, actor=user, now=NOW
    )
    assert Job.objects.get(id=job.id).version == 1


def test_trigger_and_backfill_of_a_finished_job_create_nothing(make_job, user):
    job = make_job(now=NOW, schedule=HOURLY)
    Job.objects.filter(id=job.id).update(state=JobState.COMPLETED)
    assert job_trigger(job=job, actor=user, now=NOW) is None
    assert job_backfill(job=job, instants=[NOW], actor=user, now=NOW) is None
    assert not Run.objects.exists() and not OutboxMessage.objects.exists()


def test_trigger_and_backfill_of_a_deleted_job_create_nothing(make_job, user):
    job = make_job(now=NOW, schedule=HOURLY)
    assert job_delete(job=job, actor=user, now=NOW)
    assert not job_delete(job=job, actor=user, now=NOW)
    assert job_trigger(job=job, actor=user, now=NOW) is None
    assert not Run.objects.exists()


def test_a_second_backfill_run_of_one_occurrence_is_refused_by_the_database(make_job, user):
    job = make_job(now=NOW, schedule=HOURLY)
    [run] = job_backfill(job=job, instants=[NOW], actor=user, now=NOW).created
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.create(
            job=job,
            job_version=run.job_version,
            kind=RunKind.BACKFILL,
            state=RunState.QUEUED,
            scheduled_for=NOW,
            due_at=NOW,
            created_at=NOW,
            idempotency_key=backfill_key(job.id, NOW) + "-other",
        )
    # A scheduled run of the same instant is another identity and may exist beside it.
    Run.objects.create(
        job=job,
        job_version=run.job_version,
        kind=RunKind.SCHEDULED,
        state=RunState.QUEUED,
        scheduled_for=NOW,
        due_at=NOW,
        created_at=NOW,
        idempotency_key="scheduled",
    )


def test_spec_diff_names_nested_fields_and_treats_labels_whole():
    before = {"name": "a", "retry": {"max_attempts": 3, "jitter": True}, "labels": {"x": "1"}}
    after = {"name": "a", "retry": {"max_attempts": 5, "jitter": True}, "labels": {"y": "2"}}
    assert spec_diff(before, after) == [
        {"field": "labels", "from": {"x": "1"}, "to": {"y": "2"}},
        {"field": "retry.max_attempts", "from": 3, "to": 5},
    ]
    assert spec_diff(before, before) == []
