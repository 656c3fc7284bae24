"""Fair shares with real processes: with SCHEDULER_OWNER_MAX_ACTIVE_RUNS=4, one owner's
flood of 120 one-second runs never has more than 4 executing, and another owner's runs
due meanwhile start on time."""

import datetime as dt
import math
import threading
import time

import pytest
from django.db import connections

from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.services import job_create_bulk
from tests.factories import job_spec, owner
from tests.processes import wait_for

pytestmark = pytest.mark.slow

LIMIT = 4
FLOOD = 120
OTHER = 10


class RunningSampler(threading.Thread):
    """Counts the owner's running attempts every 50 ms, on a connection of its own."""

    def __init__(self, owner_id) -> None:
        super().__init__(daemon=True)
        self.owner_id = owner_id
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        running = Attempt.objects.filter(run__job__owner_id=self.owner_id,
                                         state=AttemptState.RUNNING)  # fmt: skip
        try:
            while not self.done.is_set():
                self.samples.append(running.count())
                time.sleep(0.05)
        finally:
            connections.close_all()


def test_an_owner_s_flood_keeps_to_its_limit_and_another_owner_starts_on_time(stack, report_figure):
    stack.scheduler()
    stack.relay("relay", SCHEDULER_OWNER_MAX_ACTIVE_RUNS=str(LIMIT))
    stack.worker("worker-1", concurrency=3)
    stack.worker("worker-2", concurrency=3)
    flooder, other = owner("flooder"), owner("other")
    now = dt.datetime.now(dt.UTC)

    def once(at: dt.datetime, **spec) -> dict:
        return job_spec(schedule={"kind": "once", "run_at": at.isoformat()}, **spec)

    flood = job_create_bulk(
        owner=flooder,
        specs=[once(now + dt.timedelta(seconds=2), task="tests.sleep", args=[1.0])] * FLOOD,
        now=now,
    )
    sampler = RunningSampler(flooder.id)
    sampler.start()
    try:
        flood_runs = Run.objects.filter(job__in=flood)
        wait_for(lambda: flood_runs.filter(state=RunState.SUCCEEDED).count() >= 10,
                 timeout=60, message="the flood to be under way")  # fmt: skip
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
        others = job_create_bulk(owner=other, specs=[once(due, task="tests.record")] * OTHER,
                                 now=dt.datetime.now(dt.UTC))  # fmt: skip
        other_runs = Run.objects.filter(job__in=others)
        wait_for(lambda: other_runs.filter(state=RunState.SUCCEEDED).count() == OTHER,
                 timeout=60, message="the other owner's runs to succeed")  # fmt: skip
        flood_left = flood_runs.exclude(state=RunState.SUCCEEDED).count()
        wait_for(lambda: flood_runs.filter(state=RunState.SUCCEEDED).count() == FLOOD,
                 timeout=240, message="the flood to finish")  # fmt: skip
    finally:
        sampler.done.set()
        sampler.join()
    lateness = sorted(
        (run.started_at - run.due_at).total_seconds()
        for run in other_runs.only("started_at", "due_at")
    )
    p99 = lateness[math.ceil(0.99 * len(lateness)) - 1]
    report_figure(
        f"owner limit {LIMIT}: at most {max(sampler.samples)} of the flood's runs executing "
        f"at once ({len(sampler.samples)} samples); the other owner's {OTHER} runs start "
        f"with p99 lateness {p99:.2f} s (max {lateness[-1]:.2f} s) while {flood_left} of "
        f"the flood's {FLOOD} waited"
    )
    assert max(sampler.samples) <= LIMIT
    assert max(sampler.samples) == LIMIT  # the flood did use its share
    assert flood_left > 0
    assert p99 < 5.0
