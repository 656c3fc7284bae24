"""storage.jobs: each job's latest finished runs, in one statement for a batch of jobs."""

from __future__ import annotations

import datetime as dt

import pytest

from jobs.models import Job, Run, RunKind, RunState
from storage.jobs import FinishedRun, jobs_latest_finished_runs
from tests.factories import make_job

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def finished(job: Job, *states: str) -> None:
    """Runs of `job` in `states`, oldest first, one a minute."""
    version = job.versions.get()
    for n, state in enumerate(states):
        at = NOW + dt.timedelta(minutes=n)
        Run.objects.create(
            job=job, job_version=version, kind=RunKind.MANUAL, state=state, scheduled_for=at,
            due_at=at, created_at=at, finished_at=at, idempotency_key=f"{job.id}:{n}",
        )  # fmt: skip


@pytest.mark.django_db
def test_each_job_s_latest_finished_runs_newest_first(user):
    one, two = make_job(user, now=NOW, name="one"), make_job(user, now=NOW, name="two")
    finished(one, RunState.SUCCEEDED, RunState.FAILED, RunState.SKIPPED, RunState.FAILED)
    finished(two, RunState.FAILED, RunState.SUCCEEDED, RunState.CANCELLED)
    found = jobs_latest_finished_runs(limits={one.id: 2, two.id: 5})
    assert [row for row in found if row.job_id == one.id] == [
        FinishedRun(one.id, RunState.FAILED),
        FinishedRun(one.id, RunState.FAILED),
    ]  # the skipped run does not count, the oldest success is past the limit
    assert sorted(row.state for row in found if row.job_id == two.id) == [
        RunState.FAILED,
        RunState.SUCCEEDED,
    ]


@pytest.mark.django_db
def test_runs_finished_before_the_last_resume_do_not_count(user):
    job = make_job(user, now=NOW)
    finished(job, RunState.FAILED, RunState.FAILED, RunState.SUCCEEDED)
    Job.objects.filter(id=job.id).update(resumed_at=NOW + dt.timedelta(minutes=1))
    assert jobs_latest_finished_runs(limits={job.id: 3}) == [
        FinishedRun(job.id, RunState.SUCCEEDED)
    ]
    assert jobs_latest_finished_runs(limits={}) == []
