"""The scheduler's policies at their edges (dispatch.scheduler): the bounded load of active
runs for overlap, cancel_previous over a backlog, grace 0 under skip, and a pending run
created before a pause. Clocks are pinned."""

import datetime as dt

import pytest

from dispatch import materializer as materializer_module
from jobs.models import JobState, JobVersion, Run, RunKind, RunState
from jobs.services import job_pause
from tests.factories import scheduled_runs as runs_of
from tests.factories import scheduler_pass as run_once

T0 = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
H = dt.timedelta(hours=1)
HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}


def _backlog(job, count: int) -> None:
    version = JobVersion.objects.get(job=job)
    Run.objects.bulk_create(
        Run(job=job, job_version=version, kind=RunKind.SCHEDULED, state=RunState.QUEUED,
            scheduled_for=T0 - dt.timedelta(seconds=i + 1), due_at=T0, created_at=T0,
            idempotency_key=f"{job.id}:backlog:{i}")
        for i in range(count)
    )  # fmt: skip


@pytest.mark.parametrize("overlap, most", [("allow", 0), ("skip", 100)])
def test_a_pass_loads_a_bounded_number_of_active_runs(make_job, monkeypatch, overlap, most):
    job = make_job(now=T0, schedule={"kind": "interval", "every_seconds": 1}, overlap=overlap)
    _backlog(job, 500)
    monkeypatch.setattr(materializer_module, "OVERLAP_RUNS_PER_JOB", 100)
    loaded = []
    original = Run.from_db.__func__
    monkeypatch.setattr(
        Run, "from_db", classmethod(lambda cls, *a: loaded.append(1) or original(cls, *a))
    )
    run_once(T0 + dt.timedelta(milliseconds=500))
    assert len(loaded) <= most
    new = Run.objects.get(job=job, scheduled_for=T0)
    assert new.state == (RunState.QUEUED if overlap == "allow" else RunState.SKIPPED)


def test_cancel_previous_still_cancels_the_newest_active_runs(make_job):
    job = make_job(
        now=T0, schedule={"kind": "interval", "every_seconds": 60}, overlap="cancel_previous"
    )
    _backlog(job, 3)
    run_once(T0 + dt.timedelta(seconds=1))
    assert sorted(state for _, state in runs_of(job)) == ["cancelled"] * 3 + ["queued"]


def test_grace_zero_does_not_skip_an_occurrence_reached_on_time(make_job):
    job = make_job(
        now=T0 - dt.timedelta(minutes=1),
        schedule=HOURLY,
        misfire={"policy": "skip", "grace_seconds": 0},
    )
    run_once(T0 + dt.timedelta(milliseconds=5))
    run_once(T0 + H + dt.timedelta(seconds=2))
    assert runs_of(job) == [(T0, RunState.QUEUED), (T0 + H, RunState.SKIPPED)]


def test_a_pending_run_created_before_a_pause_is_released(make_job, user):
    job = make_job(
        now=T0 - dt.timedelta(minutes=1),
        schedule={"kind": "once", "run_at": T0.isoformat()},
        jitter_seconds=3600,
    )
    run_once(T0)
    run = Run.objects.get(job=job)
    assert run.state == RunState.PENDING
    job_pause(job=job, actor=user, now=T0 + dt.timedelta(seconds=1))
    run_once(T0 + 2 * H)
    run.refresh_from_db()
    assert run.state == RunState.QUEUED
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
