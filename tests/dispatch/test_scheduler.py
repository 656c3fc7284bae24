"""The scheduler loop's edges: a schedule that can no longer be evaluated, and sleeping."""

import datetime as dt

from dispatch.scheduler import SchedulerConfig, scheduler_run_once, scheduler_sleep_seconds
from jobs.models import AuditEvent, Job, Run

NOW = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)


def test_a_job_whose_zone_vanished_runs_its_occurrence_then_stops_visibly(make_job):
    job = make_job(
        now=NOW - dt.timedelta(minutes=30),
        schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"},
    )
    spec = job.spec | {"schedule": job.spec["schedule"] | {"timezone": "Gone/Zone"}}
    Job.objects.filter(id=job.id).update(spec=spec)
    other = make_job(
        now=NOW - dt.timedelta(minutes=30),
        schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"},
    )

    result = scheduler_run_once(now=NOW, config=SchedulerConfig())

    assert result.runs_created == 2  # the broken job did not fail the batch
    job.refresh_from_db()
    other.refresh_from_db()
    assert job.next_run_at is None
    assert other.next_run_at == NOW + dt.timedelta(hours=1)
    event = AuditEvent.objects.get(job=job, action="job.schedule_error")
    assert "Gone/Zone" in event.data["error"]
    assert Run.objects.filter(job=job, scheduled_for=NOW).exists()


def test_sleep_is_until_the_next_due_instant_capped_by_the_poll_interval(make_job):
    config = SchedulerConfig(poll_interval=1.0)
    assert scheduler_sleep_seconds(now=NOW, config=config) == 1.0  # nothing scheduled
    make_job(
        now=NOW, schedule={"kind": "once", "run_at": (NOW + dt.timedelta(seconds=0.3)).isoformat()}
    )
    assert scheduler_sleep_seconds(now=NOW, config=config) == 0.3
    assert scheduler_sleep_seconds(now=NOW + dt.timedelta(seconds=5), config=config) == 0.0
