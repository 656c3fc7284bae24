"""Lanes (jobs/lanes.py): backfill runs, manual triggers and replayed runs travel in their
own queues, which workers of the configured queue consume too, so near-term scheduled runs
are never queued behind bulk work."""

import datetime as dt
import math

import pytest
from celery import current_app
from django.db.models import Q

from dispatch.reaper import ReaperConfig, reaper_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.lanes import LANES, lane_queue, lane_queues, lanes_of
from jobs.models import OutboxMessage, Run, RunKind, RunState
from jobs.schedules import backfill_occurrences
from jobs.services import job_backfill, job_create_bulk, job_trigger, run_replay_request
from tests.factories import PINNED_NOW, claim, job_spec, later, make_job, owner
from tests.processes import wait_for


def test_each_kind_has_its_lane_and_scheduled_runs_keep_the_queue():
    assert set(LANES) == set(RunKind.values) - {RunKind.SCHEDULED}
    assert lane_queue("jobs", RunKind.SCHEDULED) == "jobs"
    assert lane_queue("jobs", RunKind.BACKFILL) == "jobs.backfill"
    assert lane_queue("jobs", RunKind.MANUAL) == "jobs.manual"
    # A replayed run goes to the replay lane whatever its kind.
    for kind in RunKind.values:
        assert lane_queue("jobs", kind, replayed=True) == "jobs.replay"
    assert lanes_of("jobs") == ["jobs.backfill", "jobs.manual", "jobs.replay"]
    assert lane_queues(["jobs", "reports"]) == [
        "jobs", "jobs.backfill", "jobs.manual", "jobs.replay",
        "reports", "reports.backfill", "reports.manual", "reports.replay",
    ]  # fmt: skip
    # Declared as the configured queues are (quorum where configured), same exchange scheme.
    declared = current_app.amqp.queues
    for name in lane_queues(["jobs"]):
        assert declared[name].queue_arguments == declared["jobs"].queue_arguments
        assert (declared[name].exchange.name, declared[name].routing_key) == (name, name)


@pytest.mark.django_db
def test_backfill_and_trigger_write_their_rows_to_their_lanes(user):
    now = dt.datetime.now(dt.UTC)
    job = make_job(user, now=now, schedule={"kind": "cron", "expression": "0 * * * *"})
    instants = backfill_occurrences(job=job, start=now - dt.timedelta(hours=3), end=now)
    result = job_backfill(job=job, instants=instants, actor=user, now=now)
    run = job_trigger(job=job, actor=user, now=now)
    rows = dict(OutboxMessage.objects.values_list("run_id", "queue"))
    assert rows == {
        **{backfilled.id: "jobs.backfill" for backfilled in result.created},
        run.id: "jobs.manual",
    }
    assert len(result.created) == 3


def _failed(run) -> None:
    """The run failed (out of the outbox), as its last attempt would leave it."""
    OutboxMessage.objects.filter(run=run).delete()
    Run.objects.filter(id=run.id).update(state=RunState.FAILED, failure_reason="error")


@pytest.mark.django_db
def test_a_replayed_run_and_its_retries_travel_in_the_replay_lane(queued_run, user):
    """The replay stamps `replayed_at` (the database's now) and writes the row to
    `<queue>.replay`; the retry of the replayed run goes there too, and so does a
    replayed backfill run."""
    run = queued_run(retry={"max_attempts": 2})
    assert OutboxMessage.objects.get(run=run).queue == "jobs"
    _failed(run)

    assert run_replay_request(run=run, actor=user, now=later(100)) is True
    run.refresh_from_db()
    assert run.replayed_at is not None and run.state == RunState.QUEUED
    assert list(OutboxMessage.objects.filter(run=run).values_list("queue", flat=True)) == [
        "jobs.replay"
    ]
    OutboxMessage.objects.filter(run=run).delete()  # published
    claim(run, at=later(200))
    assert reaper_run_once(now=later(231), config=ReaperConfig()).lost == 1
    run.refresh_from_db()
    assert run.state == RunState.RETRY_WAIT
    promoted = scheduler_run_once(now=run.next_attempt_at, config=SchedulerConfig())
    assert promoted.retries_queued == 1
    assert list(OutboxMessage.objects.filter(run=run).values_list("queue", flat=True)) == [
        "jobs.replay"
    ]

    cron = make_job(user, now=PINNED_NOW, schedule={"kind": "cron", "expression": "0 0 1 1 *"})
    backfilled = job_backfill(job=cron, instants=[PINNED_NOW - dt.timedelta(days=1)],
                              actor=user, now=PINNED_NOW).created[0]  # fmt: skip
    assert OutboxMessage.objects.get(run=backfilled).queue == "jobs.backfill"
    _failed(backfilled)
    assert run_replay_request(run=backfilled, actor=user, now=later(400)) is True
    assert OutboxMessage.objects.get(run=backfilled).queue == "jobs.replay"


@pytest.mark.slow
def test_a_worker_of_the_queue_consumes_its_lanes(stack, user):
    """`celery worker -Q jobs` (dispatch.commands.worker_argv) names no lane: the worker
    adds them (scheduler_project/celery.py), and runs a trigger, a backfill and a replay."""
    stack.scheduler()
    stack.relay()
    stack.worker(concurrency=1)
    banner = stack.log("worker").decode(errors="replace")
    assert all(f"{name} " in banner for name in lane_queues(["jobs"])), banner
    now = dt.datetime.now(dt.UTC)
    job = make_job(user, now=now, schedule={"kind": "cron", "expression": "0 0 1 1 *"})
    [backfilled] = job_backfill(job=job, instants=[now - dt.timedelta(days=1)], actor=user,
                                now=now).created  # fmt: skip
    triggered = job_trigger(job=job, actor=user, now=now)
    wait_for(
        lambda: Run.objects.filter(id__in=[backfilled.id, triggered.id],
                                   state=RunState.SUCCEEDED).count() == 2,
        timeout=60,
        message="the backfill and the manual run to succeed",
    )  # fmt: skip
    # The manual run, failed as a worker would leave it, then replayed: to `jobs.replay`.
    Run.objects.filter(id=triggered.id).update(state=RunState.FAILED, failure_reason="error")
    replayed = Run.objects.select_related("job_version").get(id=triggered.id)
    assert run_replay_request(run=replayed, actor=user, now=dt.datetime.now(dt.UTC))
    wait_for(
        lambda: Run.objects.filter(id=replayed.id, state=RunState.SUCCEEDED).exists(),
        timeout=60,
        message="the replayed run to succeed",
    )
    assert replayed.attempts.count() == 2


BACKFILL = 5000
NEAR_TERM = 100


@pytest.mark.slow
def test_near_term_runs_start_on_time_while_a_large_backfill_drains(stack, report_figure):
    """5,000 backfill runs of a cron job (`* * * * *` over ~3.5 days), then 100 one-time
    runs due 5 s later: they start within seconds of their due time while the backfill,
    queued first, is still draining beside them."""
    stack.scheduler()
    stack.relay()
    stack.worker("worker-1", concurrency=2)
    stack.worker("worker-2", concurrency=2)
    user = owner("lanes")
    now = dt.datetime.now(dt.UTC)
    # A task declaring pack=1: a short task's backfill would travel packed and be done
    # before the near-term runs fall due, and the test would prove nothing.
    cron = make_job(user, now=now, task="tests.record_alone",
                    schedule={"kind": "cron", "expression": "* * * * *"})  # fmt: skip
    start = (now - dt.timedelta(days=4)).replace(second=0, microsecond=0)
    for chunk in range(BACKFILL // 1000):
        begin = start + dt.timedelta(minutes=1000 * chunk)
        instants = backfill_occurrences(
            job=cron, start=begin, end=begin + dt.timedelta(minutes=1000)
        )
        assert len(instants) == 1000
        job_backfill(job=cron, instants=instants, actor=user, now=dt.datetime.now(dt.UTC))
    backfill = Run.objects.filter(job=cron, kind=RunKind.BACKFILL)
    wait_for(lambda: backfill.filter(state=RunState.SUCCEEDED).exists(), timeout=60,
             message="the backfill to start draining")  # fmt: skip

    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    spec = job_spec(task="tests.record", schedule={"kind": "once", "run_at": due.isoformat()})
    jobs = job_create_bulk(owner=user, specs=[spec] * NEAR_TERM, now=dt.datetime.now(dt.UTC))
    near = Run.objects.filter(job__in=jobs)
    wait_for(lambda: near.filter(state=RunState.SUCCEEDED).count() == NEAR_TERM, timeout=120,
             message="the near-term runs to succeed")  # fmt: skip
    runs = list(near.only("started_at", "due_at"))
    lateness = sorted((run.started_at - run.due_at).total_seconds() for run in runs)
    # Backfill runs still to finish when the last near-term run started: read from the
    # rows, not counted when the test looks (a fast box drains the rest meanwhile).
    last_start = max(run.started_at for run in runs)
    unfinished = backfill.filter(
        Q(finished_at__isnull=True) | Q(finished_at__gt=last_start)
    ).count()
    p99 = lateness[math.ceil(0.99 * len(lateness)) - 1]
    report_figure(
        f"{NEAR_TERM} near-term runs beside a backfill of {BACKFILL}: start lateness p50 "
        f"{lateness[len(lateness) // 2]:.2f} s, p99 {p99:.2f} s, max {lateness[-1]:.2f} s; "
        f"{unfinished} backfill runs still unfinished when the last of them started"
    )
    assert p99 < 5.0
    assert unfinished > 0, "the backfill had drained: the test proved nothing"


REPLAYED = 5000


@pytest.mark.slow
def test_near_term_runs_start_on_time_while_a_large_bulk_replay_drains(stack, report_figure):
    """5,000 failed runs replayed by a bulk operation (the relay works it), then 100
    one-time runs due 5 s later: they start within seconds of their due time while the
    replays, queued first, are still draining beside them in `jobs.replay`."""
    from jobs.models import BulkOperation, BulkOperationItem

    user = owner("replays")
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    # A task declaring pack=1, as above: packed, the replays would be done too soon.
    spec = job_spec(
        task="tests.record_alone", schedule={"kind": "once", "run_at": past.isoformat()}
    )
    failed = job_create_bulk(
        owner=user, specs=[spec] * REPLAYED, now=past - dt.timedelta(minutes=1)
    )
    while scheduler_run_once(now=dt.datetime.now(dt.UTC), config=SchedulerConfig()).batch_full:
        pass
    runs = Run.objects.filter(job__in=failed)
    OutboxMessage.objects.filter(run__in=runs).delete()
    runs.update(state=RunState.FAILED, failure_reason="error", finished_at=past)
    operation = BulkOperation.objects.create(owner=user, action="runs.replay", matched=REPLAYED)
    BulkOperationItem.objects.bulk_create(
        BulkOperationItem(operation=operation, target=run_id)
        for run_id in runs.values_list("id", flat=True)
    )
    stack.scheduler()
    # One worker slot: the replays (a batch of 100 between two relay steps) enter faster
    # than it drains them, so a backlog builds up in the broker, as a large replay's does.
    stack.relay()
    stack.worker("worker-1", concurrency=1)
    progress = BulkOperation.objects.filter(id=operation.id)
    wait_for(lambda: progress.values_list("done", flat=True)[0] >= REPLAYED // 2, timeout=120,
             message="half the replays queued")  # fmt: skip

    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    spec = job_spec(task="tests.record", schedule={"kind": "once", "run_at": due.isoformat()})
    jobs = job_create_bulk(owner=user, specs=[spec] * NEAR_TERM, now=dt.datetime.now(dt.UTC))
    near = Run.objects.filter(job__in=jobs)
    wait_for(lambda: near.filter(state=RunState.SUCCEEDED).count() == NEAR_TERM, timeout=120,
             message="the near-term runs to succeed")  # fmt: skip
    unfinished = runs.exclude(state=RunState.SUCCEEDED).count()
    lateness = sorted(
        (run.started_at - run.due_at).total_seconds() for run in near.only("started_at", "due_at")
    )
    p99 = lateness[math.ceil(0.99 * len(lateness)) - 1]
    report_figure(
        f"{NEAR_TERM} near-term runs beside a bulk replay of {REPLAYED}: start lateness p50 "
        f"{lateness[len(lateness) // 2]:.2f} s, p99 {p99:.2f} s, max {lateness[-1]:.2f} s; "
        f"{unfinished} replayed runs still unfinished then"
    )
    # In the job's queue itself (the replays ahead of them), p99 4.6-8.3 s.
    assert p99 < 3.0
    assert unfinished > 0, "the replays had drained: the test proved nothing"
