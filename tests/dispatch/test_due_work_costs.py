"""Costs that grow with due work only: the completer, reconciliation, the
overlap and pause_after_failures checks and the pruner read their rows through partial
indexes that hold only what they look for, shown by their plans (with sequential scans
off: on a test's tiny tables the planner would rightly scan, so what is shown is that the
index serves the query, its predicate implied by the query's); and reconciliation
examines a bounded window of queued runs per pass, asking the broker outside any
transaction."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from dispatch.completer import _awaiting, _finished
from dispatch.materializer import active_scheduled_runs
from dispatch.reconciler import (
    ReconcileConfig,
    ReconcileWindow,
    _mark_held,
    _oldest_stuck,
    _window,
    reconcile_run_once,
)
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import Job, JobVersion, OutboxMessage, Run, RunState
from jobs.selectors import oldest_pending_outbox, oldest_queued_at
from storage.jobs import LATEST_FINISHED
from tests.factories import make_job, publish

pytestmark = pytest.mark.django_db

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)


def history(job: Job, runs: int) -> None:
    """`runs` finished runs of `job` (a minute apart, before NOW), as months of an interval
    job leave them, and fresh statistics: the planner then chooses by real sizes."""
    version = JobVersion.objects.get(job=job, version=job.version)
    at = [NOW - dt.timedelta(minutes=n + 1) for n in range(runs)]
    Run.objects.bulk_create(
        [Run(job=job, job_version=version, state=RunState.SUCCEEDED, scheduled_for=t,
             idempotency_key=f"history-{job.id}-{n}", attempt_count=1, fencing_token=1,
             due_at=t, created_at=t, finished_at=t)
         for n, t in enumerate(at)],
        batch_size=5000,
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_run")
        cursor.execute("ANALYZE jobs_job")


def plan(sql: str, params=None) -> str:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def queryset_plan(queryset) -> str:
    sql, params = queryset.query.sql_with_params()
    return plan(sql, params)


def test_the_completer_reads_only_jobs_awaiting_completion_and_their_active_runs(user):
    job = make_job(user, now=NOW)
    history(job, 5000)
    window = _awaiting(Job.objects.all()).order_by("id").values_list("id", flat=True)[:2000]
    assert "job_awaiting_completion_idx" in queryset_plan(window)
    probe = queryset_plan(_finished(Job.objects.filter(id__in=[job.id])))
    assert "run_job_active_idx" in probe, probe


def test_overlap_reads_only_the_jobs_active_runs(user):
    job = make_job(user, now=NOW, overlap="skip")
    history(job, 5000)
    assert "run_job_active_idx" in queryset_plan(active_scheduled_runs([job.id]))


def test_pause_after_failures_reads_each_jobs_latest_finished_runs_only(user):
    job = make_job(user, now=NOW, pause_after_failures=3)
    for other in [make_job(user, now=NOW, name=f"other {n}") for n in range(4)]:
        history(other, 5000)
    history(job, 5000)
    text = plan(LATEST_FINISHED, {"jobs": [job.id], "limits": [3]})
    assert "run_job_finished_idx" in text and "Limit" in text, text


def test_reconciliation_reads_its_window_from_the_unheld_queued_runs_index():
    window = ReconcileWindow(end=(NOW - dt.timedelta(hours=1), uuid.uuid4()))
    with CaptureQueriesContext(connection) as queries:
        _window(now=NOW, config=ReconcileConfig(), window=window)
    selects = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT")]
    assert len(selects) == 3, selects  # the oldest tenth, the walk, the wrap
    for sql in selects:
        text = plan(sql)
        assert "run_queued_unheld_idx" in text, text
    with CaptureQueriesContext(connection) as queries:
        oldest_queued_at()  # the dashboard's, beside the oldest pending outbox row
    assert "run_queued_unheld_idx" in plan(queries.captured_queries[0]["sql"])
    with CaptureQueriesContext(connection) as queries:
        _mark_held(now=NOW, config=ReconcileConfig(), ids=None)
    text = plan(queries.captured_queries[0]["sql"])
    assert "run_queued_unheld_idx" in text and "Limit" in text, text


def test_a_lost_run_is_found_in_passes_independent_of_the_runs_held_back(user):
    """5,000 runs queued two hours ago whose messages still wait in the outbox (an owner at
    its limit, a paused queue), and one run published an hour ago whose message was lost:
    with windows of 100, walking the held runs would take 56 passes to reach it; they are
    marked held (once) and skipped, so it is published again at the first pass, and a
    second one lost later at the next, while the held runs wait untouched."""
    job = make_job(user, now=NOW - dt.timedelta(hours=4))
    version = job.versions.get()
    held_at = NOW - dt.timedelta(hours=2)
    Run.objects.bulk_create(
        Run(job=job, job_version=version, kind="manual", state=RunState.QUEUED,
            scheduled_for=held_at, idempotency_key=f"held {n}", due_at=held_at,
            created_at=held_at)
        for n in range(5000)
    )  # fmt: skip
    Run.objects.update(updated_at=F("created_at"))
    OutboxMessage.objects.bulk_create(
        OutboxMessage(run_id=run_id, owner=user, task_name="tests.record", queue="jobs",
                      created_at=held_at)
        for run_id in Run.objects.values_list("id", flat=True)
    )  # fmt: skip

    def lost_run(name: str, at: dt.datetime) -> Run:
        run = Run.objects.create(
            job=job, job_version=version, kind="manual", state=RunState.QUEUED,
            scheduled_for=at, idempotency_key=name, due_at=at, created_at=at,
        )  # fmt: skip
        Run.objects.filter(id=run.id).update(updated_at=at)  # published, then lost
        return run

    first = lost_run("lost first", NOW - dt.timedelta(hours=1))
    config = ReconcileConfig(queued_after_seconds=300, scan_size=100)
    window = ReconcileWindow()

    def reconcile(now: dt.datetime) -> int:
        return reconcile_run_once(
            now=now, config=config, queue_depth=lambda queue: 0, window=window
        ).republished

    assert reconcile(NOW) == 1
    assert Run.objects.get(id=first.id).republish_count == 1
    second = lost_run("lost second", NOW - dt.timedelta(minutes=30))
    assert reconcile(NOW + dt.timedelta(seconds=5)) == 1
    assert Run.objects.get(id=second.id).republish_count == 1
    assert OutboxMessage.objects.filter(run__idempotency_key__startswith="held").count() == 5000
    assert not Run.objects.filter(idempotency_key__startswith="held", republish_count__gt=0)


def test_the_stuck_outbox_alarm_and_metrics_read_the_oldest_pending_rows_by_index():
    """The backlog backpressure keeps on purpose may be long: the alarm's oldest stuck rows
    and /metrics' oldest pending row come from outbox_pending_age_idx, not a scan of it."""
    text = queryset_plan(_oldest_stuck(NOW))
    assert "outbox_pending_age_idx" in text and "Limit" in text, text
    text = queryset_plan(oldest_pending_outbox()[:1])
    assert "outbox_pending_age_idx" in text and "Limit" in text, text


def lost_runs(user, count: int) -> list[Run]:
    """`count` one-time jobs' runs, published an hour ago and never claimed."""
    for n in range(count):
        at = NOW - dt.timedelta(hours=1, seconds=n)
        make_job(user, now=at - dt.timedelta(minutes=1), name=f"lost {n}",
                 schedule={"kind": "once", "run_at": at.isoformat()})  # fmt: skip
    scheduler_run_once(now=NOW - dt.timedelta(minutes=59), config=SchedulerConfig())
    runs = list(Run.objects.all())
    for run in runs:
        publish(run, at=NOW - dt.timedelta(hours=1))
    return runs


def test_reconciliation_examines_a_bounded_window_and_finds_every_lost_run_in_time(user):
    runs = lost_runs(user, 12)
    config = ReconcileConfig(queued_after_seconds=300, scan_size=5)
    window = ReconcileWindow()  # the loop's, carried from pass to pass
    assert len(_window(now=NOW, config=config, window=window)) == 5
    outer, depths = len(connection.atomic_blocks), []  # the test's own transaction

    def depth(queue: str) -> int:
        depths.append(len(connection.atomic_blocks) - outer)
        return 0  # idle: every examined run is lost

    passes = []
    while Run.objects.filter(republish_count=0).exists() and len(passes) < 10:
        result = reconcile_run_once(now=NOW, config=config, queue_depth=depth, window=window)
        passes.append(result.republished)
    assert max(passes) <= 5  # no pass looked past its window
    assert sum(passes) == len(runs) and len(passes) <= 3, passes
    assert depths and not any(depths)  # the broker is asked outside any transaction


def test_every_queued_run_is_examined_within_its_share_of_passes_ties_included(user):
    """Runs made by one statement share their `updated_at`: the windows walk the queued
    runs by (updated_at, id) from where the previous walk ended, so 23 queued runs, 20 of
    them tied, are all examined within ceil(22 / 9) = 3 windows of 10, whatever came
    before; the oldest (where a lost run stays) is in every window."""
    job = make_job(user, now=NOW - dt.timedelta(hours=4))
    version = job.versions.get()
    tied = NOW - dt.timedelta(hours=1)
    instants = [NOW - dt.timedelta(hours=3), *[tied] * 20, *[tied + dt.timedelta(seconds=1)] * 2]
    Run.objects.bulk_create(
        Run(job=job, job_version=version, kind="manual", state=RunState.QUEUED, scheduled_for=at,
            idempotency_key=f"window {n}", due_at=at, created_at=at)
        for n, at in enumerate(instants)
    )  # fmt: skip
    Run.objects.update(updated_at=F("created_at"))
    oldest = Run.objects.get(idempotency_key="window 0")
    config = ReconcileConfig(queued_after_seconds=300, scan_size=10)
    window = ReconcileWindow()
    _window(now=NOW, config=config, window=window)  # wherever an earlier window left off
    windows = [_window(now=NOW, config=config, window=window) for _ in range(3)]
    assert all(len(window) == len(set(window)) == 10 for window in windows)
    assert all(oldest.id in window for window in windows)
    seen = {run_id for window in windows for run_id in window}
    assert seen == set(Run.objects.values_list("id", flat=True))
