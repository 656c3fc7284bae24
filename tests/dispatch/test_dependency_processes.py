"""Chains of jobs run by real processes (scheduler, relay, Celery workers): each dependent
run starts after its upstream run finished, once per occurrence, through SIGKILLed workers
and a restarted scheduler."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from jobs.models import Job, Run, RunState
from jobs.schedules import backfill_occurrences
from jobs.services import job_backfill
from tests.processes import wait_for

pytestmark = pytest.mark.slow


# A cron head whose scheduled occurrences start in 2099: its runs in these tests are the
# backfilled ones only (an explicit backfill is not bounded by start_at), counted exactly.
CRON_HEAD = {"schedule": {"kind": "cron", "expression": "* * * * *"},
             "start_at": "2099-01-01T00:00:00Z"}  # fmt: skip


def _chain(make_job, head, now):
    a = make_job(now=now, name="A", task="tests.record", **head)
    b = make_job(now=now, name="B", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(a.id)]})  # fmt: skip
    c = make_job(now=now, name="C", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(b.id)]})  # fmt: skip
    return a, b, c


def _assert_links(upper, lower, count):
    """Each run of `lower` lists its run of `upper`, has its instant and kind, and started
    after it finished; `count` of each, all succeeded."""
    uppers = {run.id: run for run in Run.objects.filter(job=upper)}
    lowers = list(Run.objects.filter(job=lower))
    assert len(uppers) == len(lowers) == count
    for run in lowers:
        assert run.state == RunState.SUCCEEDED
        [parent_id] = run.upstream_runs
        parent = uppers[parent_id]
        assert (parent.scheduled_for, parent.kind) == (run.scheduled_for, run.kind)
        assert run.started_at >= parent.finished_at


def test_a_one_time_and_a_cron_head_each_run_their_chain_once(stack, make_job):
    now = dt.datetime.now(dt.UTC)
    run_at = (now + dt.timedelta(seconds=1)).isoformat()
    once = _chain(make_job, {"schedule": {"kind": "once", "run_at": run_at}}, now)
    # A cron head's occurrence from the past, by a one-run backfill: the path of any
    # occurrence, without waiting for a minute's boundary.
    cron = _chain(make_job, CRON_HEAD, now)
    minute = now.replace(second=0, microsecond=0)
    instants = backfill_occurrences(job=cron[0], start=minute - dt.timedelta(minutes=1), end=minute)
    assert job_backfill(job=cron[0], instants=instants, actor=cron[0].owner, now=now)
    stack.scheduler()
    stack.relay()
    stack.worker()
    wait_for(lambda: Run.objects.filter(job__in=[once[2], cron[2]], state="succeeded").count() == 2,
             timeout=90, message="both chains' C runs")  # fmt: skip
    time.sleep(1.5)  # nothing more comes
    for a, b, c in (once, cron):
        _assert_links(a, b, 1)
        _assert_links(b, c, 1)
    assert Run.objects.get(job=cron[2]).kind == "backfill"  # the head's kind travels down
    assert Job.objects.get(id=once[1].id).state == "active"  # never completed for it


@pytest.mark.drill
def test_a_hundred_head_runs_give_a_hundred_of_each_through_kills_and_a_restart(stack, make_job):
    now = dt.datetime.now(dt.UTC)
    a, b, c = _chain(make_job, CRON_HEAD, now)
    minute = now.replace(second=0, microsecond=0)
    instants = backfill_occurrences(job=a, start=minute - dt.timedelta(minutes=100), end=minute)
    assert len(instants) == 100
    stack.scheduler()
    stack.relay()
    stack.worker("w1")
    stack.worker("w2")
    assert job_backfill(job=a, instants=instants, actor=a.owner, now=now)

    def ended(job):
        return Run.objects.filter(job=job, state__in=["succeeded", "failed"]).count()

    wait_for(lambda: ended(b) >= 20, timeout=180, message="20 B runs")
    stack.kill("w1")
    stack.kill("w2")
    stack.kill("scheduler")
    stack.restart("scheduler")
    stack.restart("w1")
    stack.restart("w2")
    wait_for(lambda: ended(c) >= 60, timeout=300, message="60 C runs")
    stack.kill("w2")
    stack.kill("scheduler")
    stack.restart("scheduler")
    wait_for(lambda: ended(c) == 100, timeout=600, interval=1, message="100 C runs")
    time.sleep(3)
    _assert_links(a, b, 100)
    _assert_links(b, c, 100)
