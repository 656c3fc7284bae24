"""storage.rows: rows of several models in one INSERT statement."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs.models import AuditEvent, Job, JobVersion
from storage.rows import rows_insert
from tests.factories import job_spec

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def unsaved_jobs(owner, count: int) -> list[Job]:
    specs = [job_spec(name=f"job {n}") for n in range(count)]
    return [
        Job(owner=owner, name=spec["name"], task=spec["task"], spec=spec, queue=spec["queue"],
            priority=spec["priority"], labels=spec["labels"], created_at=NOW)
        for spec in specs
    ]  # fmt: skip


@pytest.mark.django_db
def test_groups_of_several_models_are_inserted_in_one_statement(user):
    jobs = unsaved_jobs(user, 3)
    versions = [JobVersion(job=job, version=1, spec=job.spec, created_by=user) for job in jobs]
    events = [AuditEvent(actor=user, actor_label="user:x", action="job.created", job_id=job.id,
                         data={"n": n}) for n, job in enumerate(jobs)]  # fmt: skip
    with CaptureQueriesContext(connection) as queries:
        rows_insert(groups=[jobs, versions, events])
    assert len(queries) == 1
    stored = Job.objects.filter(owner=user).order_by("name")
    assert [job.name for job in stored] == ["job 0", "job 1", "job 2"]
    assert stored[0].spec == jobs[0].spec and stored[0].updated_at is not None  # auto_now
    assert JobVersion.objects.filter(job__owner=user, version=1).count() == 3
    saved = AuditEvent.objects.filter(job__owner=user).order_by("job__name")
    assert [event.data for event in saved] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert all(event.created_at is not None for event in saved)  # auto_now_add
    assert all(not job._state.adding for job in jobs)
    assert versions[0].pk is None  # a generated key is not read back


@pytest.mark.django_db
def test_nothing_to_insert_sends_no_statement():
    with CaptureQueriesContext(connection) as queries:
        rows_insert(groups=[[], []])
    assert len(queries) == 0
