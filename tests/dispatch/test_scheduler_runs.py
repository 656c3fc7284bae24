"""The scheduler's materialization of runs (dispatch.scheduler): once per occurrence,
not before it is due, never for paused jobs, and next_run_at advanced on the schedule.
Clocks are pinned."""

import datetime as dt

from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import Job, OutboxMessage, Run

CREATED = dt.datetime(2029, 12, 31, 12, 0, tzinfo=dt.UTC)
RUN_AT = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
NOW = RUN_AT + dt.timedelta(seconds=1)
CONFIG = SchedulerConfig()


def reload(obj):
    obj.refresh_from_db()
    return obj


def test_scheduler_twice_at_the_same_instant_creates_one_run(make_job):
    make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    assert scheduler_run_once(now=NOW, config=CONFIG).runs_created == 1
    assert scheduler_run_once(now=NOW, config=CONFIG).runs_created == 0
    assert Run.objects.count() == OutboxMessage.objects.count() == 1


def test_scheduler_ignores_jobs_not_yet_due(make_job):
    job = make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    assert scheduler_run_once(now=RUN_AT - dt.timedelta(seconds=1), config=CONFIG).runs_created == 0
    assert reload(job).next_run_at == RUN_AT
    assert Run.objects.count() == 0


def test_scheduler_clears_next_run_at_of_a_once_job(make_job):
    job = make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    scheduler_run_once(now=NOW, config=CONFIG)
    assert reload(job).next_run_at is None


def test_scheduler_advances_a_cron_job_to_its_next_occurrence(make_job):
    """Berlin 09:00 in winter is 08:00Z; the run records the version that created it."""
    job = make_job(
        now=CREATED,
        schedule={"kind": "cron", "expression": "0 9 * * *", "timezone": "Europe/Berlin"},
    )
    first = dt.datetime(2030, 1, 1, 8, 0, tzinfo=dt.UTC)
    assert job.next_run_at == first
    assert scheduler_run_once(now=first, config=CONFIG).runs_created == 1
    assert reload(job).next_run_at == first + dt.timedelta(days=1)
    run = Run.objects.get(job=job)
    assert (run.scheduled_for, run.job_version.version) == (first, 1)
    assert run.idempotency_key.startswith(f"{job.id}:")


def test_scheduler_advances_an_interval_job_on_its_grid(make_job):
    job = make_job(now=CREATED, schedule={"kind": "interval", "every_seconds": 300})
    assert job.next_run_at == CREATED
    assert (
        scheduler_run_once(now=CREATED + dt.timedelta(seconds=10), config=CONFIG).runs_created == 1
    )
    assert reload(job).next_run_at == CREATED + dt.timedelta(seconds=300)
    # Not due again until the next step.
    assert (
        scheduler_run_once(now=CREATED + dt.timedelta(seconds=299), config=CONFIG).runs_created == 0
    )


def test_scheduler_skips_paused_jobs(make_job):
    job = make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    Job.objects.filter(id=job.id).update(state="paused")
    assert scheduler_run_once(now=NOW, config=CONFIG).runs_created == 0


def test_scheduler_does_not_duplicate_a_run_when_next_run_at_is_rewound(make_job):
    """If next_run_at points at an occurrence that already has its run, it only advances."""
    job = make_job(
        now=CREATED, schedule={"kind": "cron", "expression": "0 0 * * *", "timezone": "UTC"}
    )
    scheduler_run_once(now=RUN_AT, config=CONFIG)
    Job.objects.filter(id=job.id).update(next_run_at=RUN_AT)
    assert scheduler_run_once(now=RUN_AT, config=CONFIG).runs_created == 0
    assert Run.objects.filter(job=job).count() == 1
    assert reload(job).next_run_at == RUN_AT + dt.timedelta(days=1)
