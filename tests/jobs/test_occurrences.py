"""The explanation of a job's occurrences predicts the decision the scheduler makes later:
for a paused job, a DST gap, an overlap skip and a misfire skip (a calendar's is in
test_calendars.py), the reason predicted is the skip reason the run then carries."""

from __future__ import annotations

import datetime as dt

from jobs.models import Job, Run
from jobs.occurrences import job_occurrences
from jobs.services import job_pause, job_resume
from tests.factories import scheduler_pass

UTC = dt.UTC
T0 = dt.datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
WIDE = dt.timedelta(days=2)


def explain(job, *, now, start=None, limit=10):
    job.refresh_from_db()
    page, _ = job_occurrences(
        job=job, start=start or now - WIDE, end=now + WIDE, cursor=None, limit=limit, now=now
    )
    return {entry["scheduled_for"]: entry for entry in page}


def cron(expression, zone="UTC", **extra) -> dict:
    return {"schedule": {"kind": "cron", "expression": expression, "timezone": zone}, **extra}


def skip_reason(job, at) -> str:
    return Run.objects.get(job=job, scheduled_for=at).skip_reason


def test_a_misfire_skip_is_predicted_with_the_reason_its_run_carries(make_job):
    job = make_job(now=T0, **cron("0 * * * *", misfire={"policy": "skip", "grace_seconds": 60}))
    due, late = T0 + dt.timedelta(hours=1), T0 + dt.timedelta(hours=1, minutes=5)
    predicted = explain(job, now=late)[due]
    assert predicted["decision"] == "will_skip"
    assert predicted["reasons"] == ["misfire: missed by 300s (policy skip)"]
    scheduler_pass(late)
    assert skip_reason(job, due) == predicted["reasons"][0]
    assert explain(job, now=late)[due]["decision"] == "skipped"


def test_an_overlap_skip_is_predicted_with_the_reason_its_run_carries(make_job):
    job = make_job(now=T0, **cron("* * * * *", overlap="skip"))
    first = T0 + dt.timedelta(minutes=1)
    scheduler_pass(first)  # a run is queued, and stays active
    following = first + dt.timedelta(minutes=1)
    predicted = explain(job, now=first + dt.timedelta(seconds=30))[following]
    assert predicted["decision"] == "will_skip"
    assert predicted["reasons"][0].startswith("overlap: run ")
    scheduler_pass(following)
    assert skip_reason(job, following) == predicted["reasons"][0]


def test_a_paused_jobs_occurrences_are_predicted_with_the_reason_they_get_on_resume(make_job, user):
    job = make_job(now=T0, **cron("0 * * * *", misfire={"policy": "skip", "grace_seconds": 60}))
    assert job_pause(job=job, actor=user, now=T0 + dt.timedelta(minutes=10))
    due = T0 + dt.timedelta(hours=1)
    predicted = explain(job, now=T0 + dt.timedelta(minutes=20))[due]
    assert predicted["decision"] == "will_skip"
    assert predicted["reasons"] == ["paused: missed while the job was paused (misfire policy skip)"]
    job.refresh_from_db()
    resumed = T0 + dt.timedelta(hours=2, minutes=30)
    assert job_resume(job=job, actor=user, now=resumed)
    scheduler_pass(resumed)
    assert skip_reason(job, due) == predicted["reasons"][0]
    assert skip_reason(job, due + dt.timedelta(hours=1)) == predicted["reasons"][0]


def test_a_dst_gap_is_explained_before_and_after_its_run(make_job):
    created = dt.datetime(2026, 3, 28, 12, tzinfo=UTC)
    job = make_job(now=created, **cron("30 2 * * *", "Europe/Berlin"))
    shifted = dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC)  # 03:00 CEST, the end of the gap
    predicted = explain(job, now=created)[shifted]
    assert predicted["decision"] == "will_run"
    assert predicted["reasons"][0].startswith("dst: a local time skipped by spring-forward")
    scheduler_pass(shifted + dt.timedelta(seconds=1))
    run = Run.objects.get(job=job, scheduled_for=shifted)
    assert run.state == "queued" and run.skip_reason == ""  # it ran: no skip reason
    after = explain(job, now=shifted + dt.timedelta(seconds=1))[shifted]
    assert after["decision"] == "waiting" and after["reasons"] == predicted["reasons"]


def test_pages_follow_one_another_without_gaps(make_job):
    job = make_job(now=T0, **cron("*/10 * * * *"))
    Job.objects.filter(id=job.id).update(next_run_at=T0 + dt.timedelta(minutes=10))
    scheduler_pass(T0 + dt.timedelta(minutes=30))  # three past runs, then predictions
    job.refresh_from_db()
    seen, cursor, end = [], None, T0 + dt.timedelta(hours=2)
    while True:
        page, last = job_occurrences(job=job, start=T0, end=end, cursor=cursor, limit=4,
                                     now=T0 + dt.timedelta(minutes=30))  # fmt: skip
        seen += [entry["scheduled_for"] for entry in page]
        if last is None:
            break
        cursor = last
    assert seen == [T0 + dt.timedelta(minutes=10 * k) for k in range(1, 12)]
    assert len({entry for entry in seen}) == len(seen)


def test_a_wall_time_skipped_by_a_dst_gap_is_explained_though_it_has_no_run(make_job):
    created = dt.datetime(2026, 3, 28, 12, tzinfo=UTC)
    job = make_job(now=created, dst={"gap": "skip", "fold": "auto"},
                   **cron("30 2 * * *", "Europe/Berlin"))  # fmt: skip
    transition = dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
    expected = "dst: 2026-03-29 02:30 does not exist in Europe/Berlin (gap: skip)"
    predicted = explain(job, now=created)
    assert predicted[transition]["decision"] == "will_skip"
    assert predicted[transition]["reasons"] == [expected]
    scheduler_pass(dt.datetime(2026, 3, 30, 1, 0, 1, tzinfo=UTC))
    assert not Run.objects.filter(job=job, scheduled_for=transition).exists()
    after = explain(job, now=dt.datetime(2026, 3, 30, 1, 0, 1, tzinfo=UTC))[transition]
    assert after["decision"] == "skipped" and after["reasons"] == [expected]
    assert after["run"] is None


def test_a_paused_queue_is_named_on_the_occurrences_that_wait_for_it(make_job):
    from jobs.models import QueueControl

    job = make_job(now=T0, **cron("0 * * * *"))
    due = T0 + dt.timedelta(hours=1)
    assert explain(job, now=T0)[due]["reasons"] == []
    QueueControl.objects.create(name=job.spec["queue"], paused=True, paused_reason="migration")
    scheduler_pass(due)  # created as usual: it waits in PostgreSQL
    page = explain(job, now=due + dt.timedelta(seconds=1))
    note = "queue: 'jobs' is paused (migration); its runs wait and start on resume"
    assert page[due]["decision"] == "waiting" and page[due]["reasons"] == [note]
    following = page[due + dt.timedelta(hours=1)]
    assert following["decision"] == "will_run" and following["reasons"] == [note]
