"""Job lifecycle and schedule policy: the defects of the fourth review, each pinned."""

from __future__ import annotations

import datetime as dt

import pytest
from drf_spectacular.generators import SchemaGenerator

from dispatch import scheduler as scheduler_module
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import AuditEvent, Job, JobState, JobVersion, Run, RunKind, RunState
from jobs.schedules import ScheduleError
from jobs.services import attempt_record_failure, job_pause, job_resume, job_update
from jobs.transitions import run_claim
from jobs.validation import job_patched_spec
from tests.factories import job_body

T0 = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
H = dt.timedelta(hours=1)
HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}
CONFIG = SchedulerConfig()

pytestmark = pytest.mark.django_db


def run_once(now: dt.datetime):
    return scheduler_run_once(now=now, config=CONFIG)


def runs_of(job) -> list[tuple[dt.datetime, str]]:
    return list(
        Run.objects.filter(job=job, kind=RunKind.SCHEDULED)
        .order_by("scheduled_for")
        .values_list("scheduled_for", "state")
    )


def patch(job, user, now, **fields) -> Job:
    job.refresh_from_db()
    spec = job_patched_spec(spec=job.spec, patch=fields)
    assert job_update(job=job, spec=spec, expected_version=job.version, actor=user, now=now)
    job.refresh_from_db()
    return job


# 1. A schedule PATCH keeps the occurrences already due for the misfire policy.


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


# 2. A jitter as long as the schedule's period is refused.


@pytest.mark.parametrize(
    "schedule, jitter",
    [
        ({"kind": "interval", "every_seconds": 60}, 3600),
        ({"kind": "interval", "every_seconds": 60}, 60),
        ({"kind": "cron", "expression": "*/5 * * * *"}, 300),
        ({"kind": "cron", "expression": "0 9,10 * * *"}, 3600),
    ],
)
def test_a_jitter_as_long_as_the_period_is_refused(api, schedule, jitter):
    r = api.post("/api/v1/jobs/", job_body(schedule=schedule, jitter_seconds=jitter), format="json")
    assert r.status_code == 400, r.json()
    assert "period" in r.json()["jitter_seconds"][0]


@pytest.mark.parametrize(
    "schedule, jitter",
    [
        ({"kind": "interval", "every_seconds": 60}, 59),
        ({"kind": "cron", "expression": "0 9 * * MON-FRI"}, 3600),
        ({"kind": "once", "run_at": "2031-01-01T00:00:00Z"}, 86400),
    ],
)
def test_a_jitter_shorter_than_the_period_is_accepted(api, schedule, jitter):
    r = api.post("/api/v1/jobs/", job_body(schedule=schedule, jitter_seconds=jitter), format="json")
    assert r.status_code == 201, r.json()


# 3. The overlap policy loads a bounded number of active runs, none for `allow`.


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
    monkeypatch.setattr(scheduler_module, "OVERLAP_RUNS_PER_JOB", 100)
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


# 4. A skipped run's reason is in the API.


def test_the_api_shows_a_skipped_runs_reason(api, make_job):
    job = make_job(now=T0 - dt.timedelta(minutes=30), schedule=HOURLY, misfire={"policy": "skip"})
    run_once(T0 + 3 * H)
    run = Run.objects.filter(job=job, state=RunState.SKIPPED).first()
    body = api.get(f"/api/v1/runs/{run.id}/").json()
    assert body["skip_reason"].startswith("misfire: missed by")
    listed = api.get(f"/api/v1/jobs/{job.id}/runs/").json()["results"]
    skipped = Run.objects.filter(job=job, state=RunState.SKIPPED)
    assert {item["skip_reason"] for item in listed if item["state"] == "skipped"} == {
        run.skip_reason for run in skipped
    }


# 5, 6. Backfill at the calendar's edge, and before an interval's anchor.


def test_a_backfill_from_year_one_is_a_400_on_start(api):
    job = api.post(
        "/api/v1/jobs/", job_body(schedule={"kind": "cron", "expression": "0 0 1 1 *"}),
        format="json",
    ).json()  # fmt: skip
    r = api.post(
        f"/api/v1/jobs/{job['id']}/backfill/",
        {"start": "0001-01-01T00:00:00Z", "end": "0001-01-02T00:00:00Z"},
        format="json",
    )
    assert r.status_code == 400
    assert "cannot be evaluated" in r.json()["start"][0]


def test_an_interval_backfill_before_the_jobs_creation_extends_its_grid_backwards(api):
    job = api.post(
        "/api/v1/jobs/", job_body(schedule={"kind": "interval", "every_seconds": 3600}),
        format="json",
    ).json()  # fmt: skip
    created_at = dt.datetime.fromisoformat(job["created_at"])
    start, end = created_at - dt.timedelta(days=1), created_at - dt.timedelta(minutes=1)
    r = api.post(
        f"/api/v1/jobs/{job['id']}/backfill/",
        {"start": start.isoformat(), "end": end.isoformat()},
        format="json",
    )
    assert r.status_code == 201
    runs = Run.objects.filter(id__in=r.json()["created"])
    assert len(runs) == 24
    # On the job's own grid: a whole number of periods before its creation.
    assert {(created_at - run.scheduled_for) % dt.timedelta(hours=1) for run in runs} == {
        dt.timedelta(0)
    }


# 7. A one-time job's run_at before its start_at.


def test_a_one_time_job_whose_run_at_is_before_start_at_is_refused(api):
    body = job_body(
        schedule={"kind": "once", "run_at": "2031-01-01T00:00:00Z"}, start_at="2032-01-01T00:00:00Z"
    )
    r = api.post("/api/v1/jobs/", body, format="json")
    assert r.status_code == 400
    assert "run_at" in r.json()["start_at"][0]


# 8, 9. PATCH: no-op, and the state checked before the body.


@pytest.mark.parametrize("body", [{}, {"name": "nightly report"}])
def test_a_patch_that_changes_nothing_makes_no_version(api, body):
    job = api.post("/api/v1/jobs/", job_body(), format="json").json()
    r = api.patch(f"/api/v1/jobs/{job['id']}/", body, format="json", HTTP_IF_MATCH="1")
    assert r.status_code == 200
    assert r.json()["version"] == 1
    assert JobVersion.objects.filter(job_id=job["id"]).count() == 1
    assert not AuditEvent.objects.filter(job_id=job["id"], action="job.updated").exists()


def test_a_patch_of_a_cancelled_job_is_409_whatever_the_body(api):
    job = api.post("/api/v1/jobs/", job_body(), format="json").json()
    api.post(f"/api/v1/jobs/{job['id']}/cancel/")
    r = api.patch(f"/api/v1/jobs/{job['id']}/", {"timeout_seconds": -1}, format="json")
    assert r.status_code == 409
    assert r.json()["state"] == "cancelled"


# 10. grace_seconds 0 under skip.


def test_grace_zero_does_not_skip_an_occurrence_reached_on_time(make_job):
    job = make_job(
        now=T0 - dt.timedelta(minutes=1),
        schedule=HOURLY,
        misfire={"policy": "skip", "grace_seconds": 0},
    )
    run_once(T0 + dt.timedelta(milliseconds=5))
    run_once(T0 + H + dt.timedelta(seconds=2))
    assert runs_of(job) == [(T0, RunState.QUEUED), (T0 + H, RunState.SKIPPED)]


# 11. The job's run list does not advertise a `job` filter.


def test_the_job_run_list_schema_has_no_job_filter():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    job_runs = [
        p["name"] for p in schema["paths"]["/api/v1/jobs/{job_id}/runs/"]["get"]["parameters"]
    ]
    all_runs = [p["name"] for p in schema["paths"]["/api/v1/runs/"]["get"]["parameters"]]
    assert "job" not in job_runs and "state" in job_runs
    assert "job" in all_runs


# 12. Runs created before a pause go on.


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


# 13. History: run-only events, and bounded.


def test_history_holds_the_events_of_the_jobs_runs(api, make_job):
    job = make_job(
        now=T0 - dt.timedelta(minutes=1), schedule={"kind": "once", "run_at": T0.isoformat()}
    )
    run_once(T0)
    run = Run.objects.get(job=job)
    attempt = run_claim(run_id=run.id, worker="w", now=T0, lease_seconds=30)
    attempt_record_failure(
        attempt=attempt, spec=job.spec, retry_base=0, ended="lost", error="lease expired",
        now=T0 + H, by="reaper",
    )  # fmt: skip
    body = api.get(f"/api/v1/jobs/{job.id}/history/").json()
    lost = [e for e in body["events"] if e["action"] == "attempt.lost"]
    assert len(lost) == 1 and lost[0]["run"] == str(run.id)
    assert body["more_events"] is False and body["more_versions"] is False


def test_history_truncates_large_values_and_caps_versions(api, make_job, user, monkeypatch):
    from jobs import selectors

    monkeypatch.setattr(selectors, "HISTORY_VERSIONS_LIMIT", 3)
    job = make_job(now=T0)
    for number in range(4):
        patch(job, user, T0, kwargs={"blob": str(number) * 10_000})
    body = api.get(f"/api/v1/jobs/{job.id}/history/").json()
    assert [v["version"] for v in body["versions"]] == [5, 4, 3]
    assert body["more_versions"] is True
    newest = body["versions"][0]
    assert newest["spec"]["kwargs"]["truncated"] is True
    assert newest["spec"]["name"] == job.spec["name"]
    assert newest["changes"][0]["field"] == "kwargs.blob"
    assert newest["changes"][0]["to"]["truncated"] is True
    assert len(api.get(f"/api/v1/jobs/{job.id}/history/").content) < 20_000


# 14. Resume after a schedule error.


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
