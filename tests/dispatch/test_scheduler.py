"""The scheduler loop's edges: a schedule that can no longer be evaluated, and sleeping:
until the next due instant, woken by a job created meanwhile, never spinning on work
another replica holds."""

import datetime as dt
import threading
import time

import pytest
from django.db import connections, transaction

from dispatch.loop import StopSignal
from dispatch.scheduler import (
    HELD_ELSEWHERE_SECONDS,
    SchedulerConfig,
    SchedulerWake,
    scheduler_run_once,
    scheduler_sleep_seconds,
)
from dispatch.wakeup import Listener
from jobs.clock import db_now
from jobs.models import AuditEvent, Job, JobVersion, Run
from jobs.notify import CHANNEL_SCHEDULE
from jobs.services import job_create, job_pause, job_resume, job_update
from tests.factories import job_spec

NOW = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)


def test_a_job_whose_zone_vanished_runs_its_occurrence_then_stops_visibly(make_job):
    job = make_job(
        now=NOW - dt.timedelta(minutes=30),
        schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"},
    )
    spec = job.spec | {"schedule": job.spec["schedule"] | {"timezone": "Gone/Zone"}}
    Job.objects.filter(id=job.id).update(spec=spec)  # a hand edit of the current spec
    JobVersion.objects.filter(job_id=job.id, version=job.version).update(spec=spec)
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


def test_due_work_held_by_another_replica_is_not_polled_in_a_spin(make_job):
    """Due before the pass began and left by it (another replica holds the job): wait a
    little rather than look again at once; due only since the pass began: at once."""
    config = SchedulerConfig(poll_interval=1.0)
    make_job(now=NOW, schedule={"kind": "once", "run_at": NOW.isoformat()})
    later = NOW + dt.timedelta(seconds=0.001)
    assert scheduler_sleep_seconds(now=later, config=config, pass_started_at=later) == (
        HELD_ELSEWHERE_SECONDS
    )
    before = NOW - dt.timedelta(seconds=0.001)
    assert scheduler_sleep_seconds(now=later, config=config, pass_started_at=before) == 0.0


def create_once(user, *, run_at: dt.datetime, now: dt.datetime) -> None:
    """A one-time job created through job_create (with its NOTIFY), committed."""
    job_create(
        owner=user, spec=job_spec(schedule={"kind": "once", "run_at": run_at.isoformat()}), now=now
    )


@pytest.mark.django_db(transaction=True)
def test_the_scheduler_wakes_for_a_job_created_while_it_sleeps(user):
    """Asleep for a long poll interval with nothing due; a job created due 0.3 s later ends
    the sleep at its due instant (the NOTIFY of job_create, then a sleep until it)."""
    config = SchedulerConfig(poll_interval=30.0)
    stop = StopSignal()
    wake = SchedulerWake(config, Listener((CHANNEL_SCHEDULE,), stop))
    try:
        assert wake.sleep_seconds() == 30.0  # nothing is due
        wake.listener.wait(0.01)  # LISTENing from here on
        due = {}

        def create() -> None:
            time.sleep(0.2)
            now = db_now()
            due["at"] = now + dt.timedelta(seconds=0.3)
            create_once(user, run_at=due["at"], now=now)
            connections.close_all()

        thread = threading.Thread(target=create)
        thread.start()
        wake.wait(30.0)
        woke_at = db_now()
        thread.join()
        assert woke_at >= due["at"]  # not before the job is due: its pass creates its run
        assert (woke_at - due["at"]).total_seconds() < 10  # and not at the next poll
    finally:
        wake.listener.close()


@pytest.mark.django_db(transaction=True)
def test_a_job_created_due_later_than_the_next_wake_does_not_end_the_sleep_early(user):
    config = SchedulerConfig(poll_interval=30.0)
    stop = StopSignal()
    wake = SchedulerWake(config, Listener((CHANNEL_SCHEDULE,), stop))
    try:
        now = db_now()
        create_once(user, run_at=now + dt.timedelta(seconds=1.0), now=now)
        seconds = wake.sleep_seconds()
        assert 0 < seconds < 1.0
        wake.listener.wait(0.01)

        def create_later_job() -> None:
            time.sleep(0.1)
            create_once(user, run_at=now + dt.timedelta(seconds=20), now=db_now())
            connections.close_all()

        thread = threading.Thread(target=create_later_job)
        thread.start()
        wake.wait(seconds)
        thread.join()
        assert db_now() >= now + dt.timedelta(seconds=1.0)  # slept on to the first job
    finally:
        wake.listener.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["create", "resume", "reschedule", "rename"])
def test_the_changes_that_can_bring_a_fire_earlier_wake_the_schedulers(user, change):
    now = db_now()
    hourly = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}
    job = job_create(owner=user, spec=job_spec(schedule=hourly), now=now)
    if change == "resume":
        job_pause(job=job, actor=user, now=now)
    listener = Listener((CHANNEL_SCHEDULE,), StopSignal())
    try:
        listener.wait(0.01)  # LISTENing from here on
        if change == "create":
            create_once(user, run_at=now + dt.timedelta(seconds=5), now=now)
        elif change == "resume":
            assert job_resume(job=Job.objects.get(id=job.id), actor=user, now=now)
        else:
            spec = job.spec | (
                {"schedule": hourly | {"expression": "*/5 * * * *"}}
                if change == "reschedule"
                else {"name": "renamed"}
            )
            assert job_update(job=job, spec=spec, expected_version=1, actor=user, now=now)
        # A rename moves no fire: no wake-up for it.
        assert listener.wait(1.0 if change == "rename" else 10.0) is (change != "rename")
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_two_replicas_claim_disjoint_due_jobs(make_job):
    """A pass that finds due jobs locked by another replica's pass skips them (SKIP
    LOCKED in the claim's inner query) instead of waiting for them."""
    from dispatch.materializer import MaterializerConfig, _claim_due_jobs, materializer_run_once

    for index in range(5):
        make_job(now=NOW, name=f"due {index}", schedule={"kind": "once", "run_at": NOW.isoformat()})
    other = {}

    def second_replica() -> None:
        try:
            other["result"] = materializer_run_once(now=NOW, config=MaterializerConfig())
        finally:
            connections.close_all()

    with transaction.atomic():
        held = {job.id for job in _claim_due_jobs(now=NOW, limit=3)}
        thread = threading.Thread(target=second_replica)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "the second replica waited on the first one's locks"
    assert other["result"].runs_created == 2
    assert not Run.objects.filter(job_id__in=held).exists()


@pytest.mark.django_db
def test_a_slow_pass_is_logged_with_the_time_of_each_step(monkeypatch, caplog):
    import dispatch.scheduler
    from dispatch.scheduler import SchedulerConfig, scheduler_run_once

    monkeypatch.setattr(dispatch.scheduler, "SLOW_PASS_SECONDS", -1.0)
    with caplog.at_level("WARNING", logger="dispatch.scheduler"):
        scheduler_run_once(now=db_now(), config=SchedulerConfig())
    (message,) = [r.getMessage() for r in caplog.records if "slow scheduler pass" in r.message]
    assert all(f"{step} " in message for step in ("materializer", "promoter", "completer"))
    assert message.endswith(": 0 runs created")
