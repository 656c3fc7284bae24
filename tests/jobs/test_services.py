"""Lifecycle services called directly: each refuses what its state forbids and writes
nothing then; the backfill constraint is the backstop behind the job's row lock."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import IntegrityError, transaction

from jobs.keys import backfill_key
from jobs.models import (
    AuditEvent,
    BackfilledOccurrences,
    Job,
    JobState,
    JobVersion,
    OutboxMessage,
    Run,
    RunKind,
    RunState,
)
from jobs.schedules import ScheduleError
from jobs.services import (
    JobQuotaExceeded,
    QuotaCounts,
    job_backfill,
    job_cancel,
    job_delete,
    job_pause,
    job_quota_check,
    job_resume,
    job_trigger,
    job_update,
    spec_diff,
)
from tests.factories import job_patch as patch
from tests.factories import scheduled_runs as runs_of
from tests.factories import scheduler_pass as run_once

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


def test_a_backfill_remembers_each_occurrence_it_ran_in_a_few_rows(make_job, user):
    """Evenly spaced instants are one row each run of them; a later backfill whose runs
    are gone (deleted here as retention would) creates exactly the instants not run."""
    job = make_job(now=NOW, schedule=HOURLY)
    hour = dt.timedelta(hours=1)
    ran = [NOW + n * hour for n in (0, 1, 2, 3, 5, 7, 9, 10)]
    assert len(job_backfill(job=job, instants=ran, actor=user, now=NOW).created) == 8
    spans = BackfilledOccurrences.objects.filter(job=job).order_by("first")
    assert [(s.first, s.last, s.step) for s in spans] == [
        (NOW, NOW + 3 * hour, hour),
        (NOW + 5 * hour, NOW + 9 * hour, 2 * hour),
        (NOW + 10 * hour, NOW + 10 * hour, dt.timedelta(0)),
    ]
    Run.objects.filter(job=job).delete()

    every = [NOW + n * hour for n in range(12)]
    again = job_backfill(job=job, instants=every, actor=user, now=NOW)
    assert [run.scheduled_for for run in again.created] == [NOW + n * hour for n in (4, 6, 8, 11)]
    assert again.pruned == ran
    assert not job_backfill(job=job, instants=every, actor=user, now=NOW).created


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


T0 = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
H = dt.timedelta(hours=1)


@pytest.mark.parametrize("policy", ["run_all", "skip"])
def test_a_schedule_patch_while_paused_leaves_the_missed_occurrences_to_the_misfire_policy(
    make_job, user, policy
):
    job = make_job(now=T0 - dt.timedelta(minutes=30), schedule=HOURLY, misfire={"policy": policy})
    run_once(T0 + dt.timedelta(seconds=1))  # 00:00 runs
    job_pause(job=job, actor=user, now=T0 + dt.timedelta(minutes=30))
    now = T0 + 3 * H + dt.timedelta(minutes=10)
    job = patch(job, user, now, end_at="2031-01-01T00:00:00Z")
    assert job.next_run_at == T0 + H  # not 04:00: 01:00-03:00 are still to be decided
    job_resume(job=job, actor=user, now=now)
    run_once(now + dt.timedelta(seconds=1))
    missed = {RunState.QUEUED if policy == "run_all" else RunState.SKIPPED}
    assert [at for at, _ in runs_of(job)] == [T0, T0 + H, T0 + 2 * H, T0 + 3 * H]
    assert {state for at, state in runs_of(job) if at > T0} == missed


def test_a_schedule_patch_just_after_an_occurrence_does_not_lose_it(make_job, user):
    job = make_job(now=T0 - dt.timedelta(minutes=30), schedule=HOURLY)
    run_once(T0 + dt.timedelta(seconds=1))
    now = T0 + H + dt.timedelta(seconds=5)  # 01:00 due, not yet materialized
    patch(job, user, now, dst={"gap": "skip", "fold": "first"})
    run_once(now + dt.timedelta(seconds=1))
    assert (T0 + H, RunState.QUEUED) in runs_of(job)


def test_a_schedule_patch_before_the_next_occurrence_moves_it_from_now(make_job, user):
    job = make_job(now=T0 - dt.timedelta(minutes=30), schedule=HOURLY)
    run_once(T0 + dt.timedelta(seconds=1))
    job = patch(
        job, user, T0 + dt.timedelta(minutes=10), schedule=HOURLY | {"expression": "30 * * * *"}
    )
    assert job.next_run_at == T0 + dt.timedelta(minutes=30)


def test_resume_is_refused_while_the_schedule_cannot_be_evaluated(api, make_job, user):
    job = make_job(now=T0, schedule=HOURLY)
    broken = job.spec | {"schedule": HOURLY | {"timezone": "Gone/Zone"}}
    Job.objects.filter(id=job.id).update(spec=broken)
    JobVersion.objects.filter(job=job).update(spec=broken)
    run_once(T0)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED and job.next_run_at is None
    with pytest.raises(ScheduleError):
        job_resume(job=job, actor=user, now=T0 + H)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
    r = api.post(f"/api/v1/jobs/{job.id}/resume/")
    assert r.status_code == 409 and "PATCH its schedule" in r.json()["detail"]
    # A PATCH of the schedule and a resume bring it back.
    job = patch(job, user, T0 + H + dt.timedelta(minutes=10), schedule=HOURLY)
    assert job.next_run_at == T0 + 2 * H
    assert job_resume(job=job, actor=user, now=T0 + H + dt.timedelta(minutes=10))
    job.refresh_from_db()
    assert job.state == JobState.ACTIVE and job.next_run_at == T0 + 2 * H


def test_resume_after_a_passing_schedule_error_goes_on_after_the_last_run(make_job, user):
    job = make_job(now=T0, schedule=HOURLY)
    run_once(T0)
    job_pause(job=job, actor=user, now=T0 + dt.timedelta(minutes=1))
    Job.objects.filter(id=job.id).update(next_run_at=None)  # as the error path leaves it
    job.refresh_from_db()
    assert job_resume(job=job, actor=user, now=T0 + 3 * H + dt.timedelta(minutes=5))
    job.refresh_from_db()
    assert job.next_run_at == T0 + H  # the misfire policy sees 01:00-03:00


@pytest.mark.django_db
def test_the_quota_check_depends_on_its_counts_object_only(make_job, user, settings):
    """Two checks with the same arguments and fresh counts agree: the recount cache is an
    object its caller owns, not a module's state, and near the limit every check counts."""
    settings.SCHEDULER_OWNER_MAX_JOBS = 2
    make_job()
    warm = QuotaCounts()
    job_quota_check(owner=user, adding=1, counts=warm)  # 1 held + 1: within the limit
    make_job()  # now 2 held: the cache of `warm` is near the limit, so it is not reused
    with pytest.raises(JobQuotaExceeded):
        job_quota_check(owner=user, adding=1, counts=warm)
    with pytest.raises(JobQuotaExceeded):
        job_quota_check(owner=user, adding=1, counts=QuotaCounts())
    assert warm.counts != {} and QuotaCounts().counts == {}
