"""Queue controls with real processes (a scheduler, relays, Celery workers): a pause holds
a queue's runs in PostgreSQL and hands back those already in the broker without charging
an attempt while another queue flows; resume drains them exactly once in due order; a cap
and a rate hold across several relays and workers. The full-size versions are drills."""

import collections
import datetime as dt
import threading
import time

import pytest
from django.db import connections
from django.test import override_settings

from dispatch.commands import worker_argv
from jobs.clock import db_now
from jobs.models import Attempt, AttemptState, OutboxMessage, Run, RunState
from jobs.queues import queue_pause, queue_resume, queue_update
from jobs.services import job_create_bulk
from tests.factories import job_spec, operator, owner
from tests.processes import purge_queue, wait_for

pytestmark = pytest.mark.slow

QUEUES = ["jobs", "other"]
ENV = {"SCHEDULER_QUEUES": ",".join(QUEUES)}


@pytest.fixture
def two_queues(stack):
    from jobs.lanes import lane_queues

    for name in lane_queues(["other"]):
        purge_queue(name)
    with override_settings(SCHEDULER_QUEUES=QUEUES):
        yield stack


def _worker(stack, name: str, concurrency: int) -> None:
    stack.start(name, worker_argv(name=name, concurrency=concurrency, queues=QUEUES), ENV)
    wait_for(lambda: b" ready." in stack.log(name), timeout=60, message=f"{name} ready")


def _jobs(user, count: int, *, due: dt.datetime, queue: str = "jobs", task="tests.record",
          args=(), spread: float = 0.0) -> list:  # fmt: skip
    specs = [
        job_spec(
            task=task,
            queue=queue,
            args=list(args),
            schedule={
                "kind": "once",
                "run_at": (due + dt.timedelta(seconds=spread * i / count)).isoformat(),
            },
        )  # fmt: skip
        for i in range(count)
    ]
    return job_create_bulk(owner=user, specs=specs, now=dt.datetime.now(dt.UTC))


def _pause_drains(stack, *, in_broker: int, due_later: int, report_figure) -> None:
    stack.scheduler("scheduler", **ENV)
    stack.relay("relay", **ENV)
    user, admin = owner("pauser"), operator("queue-operator")
    now = dt.datetime.now(dt.UTC)
    # A task declaring pack=1: packs of a short task start in pack order on each of the
    # workers' slots at once, so only runs travelling alone start in due order.
    first = _jobs(user, in_broker, due=now + dt.timedelta(seconds=1), spread=0.5,
                  task="tests.record_alone")  # fmt: skip
    first_runs = Run.objects.filter(job__in=first)
    # No worker yet: the relay publishes them and they wait in the broker.
    wait_for(lambda: first_runs.filter(state=RunState.QUEUED).count() == in_broker
             and not OutboxMessage.objects.filter(run__in=first_runs).exists(),
             timeout=120, message="the first runs to be in the broker")  # fmt: skip
    queue_pause(name="jobs", actor=admin, reason="test", until=None, now=db_now())
    acknowledged = db_now()
    later = _jobs(user, due_later, due=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2),
                  spread=2.0, task="tests.record_alone")  # fmt: skip
    _worker(stack, "worker-1", 2)
    _worker(stack, "worker-2", 2)
    others = Run.objects.filter(job__in=_jobs(user, 20, due=dt.datetime.now(dt.UTC),
                                              queue="other"))  # fmt: skip
    wait_for(lambda: others.filter(state=RunState.SUCCEEDED).count() == 20, timeout=90,
             message="the other queue's runs to run while jobs is paused")  # fmt: skip
    every = Run.objects.filter(job__in=[*first, *later])
    # Every run of the paused queue waits in PostgreSQL: the broker's handed back.
    total = in_broker + due_later
    wait_for(lambda: OutboxMessage.objects.filter(run__in=every).count() == total, timeout=120,
             message="every run of the paused queue to wait in PostgreSQL")  # fmt: skip
    held_at = db_now()
    assert not Attempt.objects.filter(run__in=every).exists()
    assert not every.exclude(attempt_count=0).exists()
    assert every.filter(state=RunState.QUEUED).count() == len(first) + len(later)
    queue_resume(name="jobs", actor=admin)
    resumed = db_now()
    wait_for(lambda: every.filter(state=RunState.SUCCEEDED).count() == total,
             timeout=120 + total / 10, message="the queue to drain after resume")  # fmt: skip
    executed = collections.Counter(
        e["run_id"] for e in stack.executions() if e["event"] == "executed"
    )
    ids = {str(run_id) for run_id in every.values_list("id", flat=True)}
    assert {run_id: n for run_id, n in executed.items() if run_id in ids and n != 1} == {}
    assert ids <= set(executed)
    started = list(Attempt.objects.filter(run__in=every).values_list(
        "run__scheduled_for", "started_at", "number"))  # fmt: skip
    assert all(number == 1 for _, _, number in started)  # none charged by the pause
    assert min(at for _, at, _ in started) > acknowledged
    # Due order: the resume renumbers the waiting rows (those handed back from the broker
    # and those created while paused) in due order and they are published so; a rank
    # correlation of their starts with their due instants (two workers of two slots start
    # neighbours in either order, so not exactly 1).
    waited = sorted(Attempt.objects.filter(run__in=every).values_list(
        "run__scheduled_for", "started_at"))  # fmt: skip
    correlation = _rank_correlation([due for due, _ in waited], [at for _, at in waited])
    lateness = sorted((at - due).total_seconds() for due, at in Attempt.objects.filter(
        run__in=others).values_list("run__scheduled_for", "started_at"))  # fmt: skip
    report_figure(
        f"pause: the other queue's {len(lateness)} runs meanwhile started late by at most "
        f"{lateness[-1]:.2f} s (median {lateness[len(lateness) // 2]:.2f} s, workers starting)"
    )
    report_figure(
        f"pause: {in_broker} runs in the broker and {due_later} due while paused held "
        f"{(held_at - acknowledged).total_seconds():.1f} s with 0 attempts; resume drained "
        f"all {total} exactly once in {(db_now() - resumed).total_seconds():.1f} s; rank "
        f"correlation of start with due instant, all {total}: "
        f"{correlation:.3f}"
    )
    assert correlation > 0.95  # 0.88 when handed-back runs went after the waiting ones


def _rank_correlation(xs: list, ys: list) -> float:
    """Spearman's rho (no ties expected)."""
    n = len(xs)
    rx = {v: i for i, v in enumerate(sorted(xs))}
    ry = {v: i for i, v in enumerate(sorted(ys))}
    d2 = sum((rx[x] - ry[y]) ** 2 for x, y in zip(xs, ys, strict=True))
    return 1 - 6 * d2 / (n * (n * n - 1))


def test_a_paused_queue_holds_its_runs_and_resume_drains_them_once(two_queues, report_figure):
    _pause_drains(two_queues, in_broker=40, due_later=40, report_figure=report_figure)


@pytest.mark.drill
@pytest.mark.timeout(1500)
def test_drill_pause_2000_due_and_200_in_the_broker(two_queues, report_figure):
    _pause_drains(two_queues, in_broker=200, due_later=2000, report_figure=report_figure)


class Sampler(threading.Thread):
    """Running attempts of the queue every 50 ms, and every attempt's start, on its own
    connection."""

    def __init__(self, runs) -> None:
        super().__init__(daemon=True)
        self.runs = runs
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        running = Attempt.objects.filter(run__in=self.runs, state=AttemptState.RUNNING,
                                         started_at__isnull=False)  # fmt: skip
        try:
            while not self.done.is_set():
                self.samples.append(running.count())
                time.sleep(0.05)
        finally:
            connections.close_all()


def _fleet(stack) -> None:
    """A scheduler, two relays and three workers of four slots each."""
    stack.scheduler("scheduler", **ENV)
    stack.relay("relay-1", **ENV)
    stack.relay("relay-2", **ENV)
    for index in range(3):
        _worker(stack, f"worker-{index}", 4)


def _cap_holds(*, cap: int, count: int, report_figure) -> None:
    admin = operator("cap-operator")
    queue_update(name="jobs", actor=admin, max_running=cap)
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    runs = Run.objects.filter(
        job__in=_jobs(owner("capped"), count, task="tests.sleep", args=[0.4], due=due)
    )
    sampler = Sampler(runs)
    sampler.start()
    try:
        wait_for(lambda: runs.filter(state=RunState.SUCCEEDED).count() == count, timeout=180,
                 message="the capped queue to drain")  # fmt: skip
    finally:
        sampler.done.set()
        sampler.join()
    report_figure(f"max_running={cap}, 2 relays, 3 workers x 4 slots: at most "
                  f"{max(sampler.samples)} running ({len(sampler.samples)} samples)")  # fmt: skip
    assert max(sampler.samples) <= cap
    assert max(sampler.samples) >= cap - 2  # the cap, not a stall, bounded it
    assert not runs.exclude(attempt_count=1).exists()  # a hand-back charges no attempt
    queue_update(name="jobs", actor=admin, max_running=None)


def _rate_holds(*, seconds: float, rate: int, report_figure) -> None:
    queue_update(name="jobs", actor=operator("rate-operator"), rate_limit=f"{rate}/s")
    count = int(rate * seconds)
    runs = Run.objects.filter(job__in=_jobs(owner("rated"), count,
                              due=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)))  # fmt: skip
    wait_for(lambda: runs.filter(state=RunState.SUCCEEDED).count() == count,
             timeout=seconds * 3 + 60, message="the rate-limited queue to drain")  # fmt: skip
    starts = sorted(Attempt.objects.filter(run__in=runs).values_list("started_at", flat=True))
    first = starts[0]
    per_second = collections.Counter(int((at - first).total_seconds()) for at in starts)
    # Any stretch of starts: at most the rate over its length, plus one burst (one
    # second's worth), plus one for a token taken a moment before its claim's clock.
    excess = max(
        (j - i + 1) - rate * (starts[j] - starts[i]).total_seconds()
        for i in range(len(starts)) for j in range(i, min(len(starts), i + 4 * rate))
    )  # fmt: skip
    report_figure(f"rate_limit {rate}/s, 2 relays, 3 workers x 4 slots: {count} runs in "
                  f"{(starts[-1] - first).total_seconds():.1f} s, busiest second "
                  f"{max(per_second.values())} starts, most starts beyond the rate in any "
                  f"stretch {excess:.1f} (burst {rate})")  # fmt: skip
    assert max(per_second.values()) <= 2 * rate
    assert excess <= rate + 1


def test_a_cap_then_a_rate_hold_across_two_relays_and_three_workers(two_queues,
                                                                    report_figure):  # fmt: skip
    _fleet(two_queues)
    _cap_holds(cap=5, count=30, report_figure=report_figure)
    _rate_holds(seconds=6, rate=20, report_figure=report_figure)


@pytest.mark.drill
@pytest.mark.timeout(1500)
def test_drill_rate_limit_for_a_minute(two_queues, report_figure):
    _fleet(two_queues)
    _cap_holds(cap=5, count=200, report_figure=report_figure)
    _rate_holds(seconds=60, rate=20, report_figure=report_figure)
