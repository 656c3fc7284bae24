"""Two upstreams of one fan-in ending at the same moment in two sessions, each session then
applying the signals as a scheduler replica would, repeated: one dependent run each time.
A third upstream ends first, so the gate exists when the two race (a gate created by the
race itself is serialized by its unique index already)."""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from dispatch.dependencies import DependenciesConfig, dependencies_run_once
from jobs.models import DependencySignal, Run
from jobs.transitions import attempt_succeed
from tests.factories import PINNED_NOW, claim, make_job, scheduler_pass
from tests.threads import in_thread

REPEATS = 25


@pytest.mark.django_db(transaction=True)
def test_two_upstreams_ending_together_make_one_dependent_run_each_time(user):
    created = PINNED_NOW - dt.timedelta(minutes=1)
    cron = {"kind": "cron", "expression": "* * * * *"}
    a1 = make_job(user, now=created, name="A1", schedule=cron)
    a2 = make_job(user, now=created, name="A2", schedule=cron)
    a0 = make_job(user, now=created, name="A0", schedule=cron)
    upstreams = [str(a0.id), str(a1.id), str(a2.id)]
    b = make_job(user, now=created, name="B", schedule={"kind": "after", "jobs": upstreams})
    last = PINNED_NOW + dt.timedelta(minutes=REPEATS - 1)
    scheduler_pass(last)
    for minute in range(REPEATS):
        at = PINNED_NOW + dt.timedelta(minutes=minute)
        ended = last + dt.timedelta(seconds=minute + 1)
        assert attempt_succeed(
            attempt=claim(Run.objects.get(job=a0, scheduled_for=at), at=ended), now=ended
        )
        dependencies_run_once(now=ended, config=DependenciesConfig())
        attempts = [claim(Run.objects.get(job=job, scheduled_for=at), at=ended) for job in (a1, a2)]
        barrier, errors = threading.Barrier(2), []

        def upstream_ends_then_apply(attempt, ended=ended, barrier=barrier):
            barrier.wait(timeout=10)
            assert attempt_succeed(attempt=attempt, now=ended)
            barrier.wait(timeout=10)
            dependencies_run_once(now=ended, config=DependenciesConfig(batch_size=1))

        threads = [in_thread(lambda a=a: upstream_ends_then_apply(a), errors) for a in attempts]
        for thread in threads:
            thread.join(timeout=30)
        assert errors == []
        dependencies_run_once(now=ended, config=DependenciesConfig())  # whatever was left
        runs = list(Run.objects.filter(job=b, scheduled_for=at).values_list("state", flat=True))
        assert runs == ["queued"], (minute, runs)
    assert not DependencySignal.objects.exists()
    assert Run.objects.filter(job=b).count() == REPEATS
