"""Chains of jobs run by real processes (scheduler, relay, Celery workers): each dependent
run starts after its upstream run finished, once per occurrence, through SIGKILLed workers
and a restarted scheduler."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from jobs.dependencies import dependency_upstream_runs
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


def upstream_of(run):
    return dependency_upstream_runs(run=run)


def _assert_links(upper, lower, count):
    """Each run of `lower` lists its run of `upper`, has its instant and kind, and started
    after it finished; `count` of each, all succeeded."""
    uppers = {run.id: run for run in Run.objects.filter(job=upper)}
    lowers = list(Run.objects.filter(job=lower))
    assert len(uppers) == len(lowers) == count
    for run in lowers:
        assert run.state == RunState.SUCCEEDED
        [parent_id] = upstream_of(run)
        parent = uppers[parent_id]
        assert (parent.scheduled_for, parent.kind) == (run.scheduled_for, run.kind)
        assert run.started_at >= parent.finished_at


@pytest.mark.drill
@pytest.mark.timeout(900)  # its waits allow up to 600 s for the last C runs on a loaded box
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


def test_a_one_time_chain_and_a_fan_in_over_twenty_cron_boundaries(stack, make_job):
    """A one-time head's chain runs once, each link after the one above finished. B after
    A1 and A2, twenty minute boundaries of their cron (backfilled, so the test need not
    wait for them): twenty B runs, none started before both of its upstream runs finished;
    A2 fails one occurrence, so B and then C are skipped there, naming why."""
    now = dt.datetime.now(dt.UTC)
    run_at = (now + dt.timedelta(seconds=1)).isoformat()
    once = _chain(make_job, {"schedule": {"kind": "once", "run_at": run_at}}, now)
    minute = now.replace(second=0, microsecond=0)
    start = minute - dt.timedelta(minutes=20)
    failing = start + dt.timedelta(minutes=7)
    a1 = make_job(now=now, name="A1", task="tests.record", **CRON_HEAD)
    a2 = make_job(now=now, name="A2", task="tests.fail_at",
                  kwargs={"instant": failing.isoformat()}, retry={"max_attempts": 1},
                  **CRON_HEAD)  # fmt: skip
    b = make_job(now=now, name="B", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(a1.id), str(a2.id)]})  # fmt: skip
    c = make_job(now=now, name="C", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(b.id)]})  # fmt: skip
    for head in (a1, a2):
        instants = backfill_occurrences(job=head, start=start, end=minute)
        assert len(instants) == 20
        assert job_backfill(job=head, instants=instants, actor=head.owner, now=now)
    stack.scheduler()
    stack.relay()
    stack.worker(concurrency=4)

    def decided(job):
        return Run.objects.filter(job=job, state__in=["succeeded", "failed", "skipped"]).count()

    wait_for(lambda: decided(c) == 20 and decided(once[2]) == 1, timeout=240, interval=0.5,
             message="20 C runs and the one-time chain's decided")  # fmt: skip
    time.sleep(1)  # nothing more comes
    _assert_links(once[0], once[1], 1)
    _assert_links(once[1], once[2], 1)
    assert Job.objects.get(id=once[1].id).state == "active"  # never completed for it
    uppers = {(run.job_id, run.scheduled_for): run for run in Run.objects.filter(job__in=[a1, a2])}
    b_runs = list(Run.objects.filter(job=b))
    assert len(b_runs) == 20
    for run in b_runs:
        ends = [uppers[(job.id, run.scheduled_for)] for job in (a1, a2)]
        assert run.kind == "backfill" and set(upstream_of(run)) <= {e.id for e in ends}
        if run.scheduled_for == failing:
            failed = uppers[(a2.id, failing)]
            assert failed.state == RunState.FAILED
            assert run.state == RunState.SKIPPED
            assert run.skip_reason.startswith(f"upstream: job {a2.id} run {failed.id} ended failed")
            skipped_b = run
        else:
            assert run.state == RunState.SUCCEEDED
            assert run.started_at >= max(e.finished_at for e in ends)
    c_skip = Run.objects.get(job=c, scheduled_for=failing)
    assert c_skip.state == RunState.SKIPPED
    assert c_skip.skip_reason.startswith(f"upstream: job {b.id} run {skipped_b.id} ended skipped")
    assert Run.objects.filter(job=c, state=RunState.SUCCEEDED).count() == 19


def test_a_fan_in_whose_other_upstream_never_runs_is_skipped_after_the_default_bound(
    stack, make_job
):
    """C after an hourly A and a daily B, no `within_seconds`: at A's hourly instants B
    never runs, so each of those gates is decided by SCHEDULER_DEPENDENCY_WITHIN_SECONDS
    (3 s here) as a `skipped` C naming A's run and the missing B; D after C follows; no
    gate is left waiting. E, after the same two with `within_seconds` 1, is decided by its
    own bound."""
    from jobs.models import DependencyGate

    now = dt.datetime.now(dt.UTC)
    hourly = {"schedule": {"kind": "cron", "expression": "0 * * * *"},
              "start_at": "2099-01-01T00:00:00Z"}  # fmt: skip
    daily = {"schedule": {"kind": "cron", "expression": "0 0 * * *"},
             "start_at": "2099-01-01T00:00:00Z"}  # fmt: skip
    a = make_job(now=now, name="A", task="tests.record", **hourly)
    b = make_job(now=now, name="B", task="tests.record", **daily)
    c = make_job(now=now, name="C", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(a.id), str(b.id)]})  # fmt: skip
    d = make_job(now=now, name="D", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(c.id)]})  # fmt: skip
    e = make_job(now=now, name="E", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(a.id), str(b.id)],
                           "within_seconds": 1})  # fmt: skip
    hour = now.replace(minute=0, second=0, microsecond=0)
    # Three past hours, none of them midnight: B has no occurrence at any of them.
    instants = [i for i in backfill_occurrences(job=a, start=hour - dt.timedelta(hours=4),
                                                end=hour) if i.hour != 0][:3]  # fmt: skip
    assert len(instants) == 3
    stack.scheduler(SCHEDULER_DEPENDENCY_WITHIN_SECONDS="3")
    stack.relay()
    stack.worker()
    assert job_backfill(job=a, instants=instants, actor=a.owner, now=now)

    def decided(job):
        return Run.objects.filter(job=job, state__in=["succeeded", "failed", "skipped"]).count()

    wait_for(lambda: decided(d) == 3 and decided(e) == 3, timeout=120, interval=0.5,
             message="3 D and 3 E runs decided")  # fmt: skip
    a_runs = {run.scheduled_for: run for run in Run.objects.filter(job=a)}
    for c_run in Run.objects.filter(job=c):
        first = a_runs[c_run.scheduled_for]
        assert first.state == RunState.SUCCEEDED
        assert c_run.state == RunState.SKIPPED
        assert c_run.skip_reason == (
            f"upstream: job {a.id} run {first.id} waited 3s (the default bound) for {b.id}"
        )
        assert c_run.created_at >= first.finished_at + dt.timedelta(seconds=3)
        d_run = Run.objects.get(job=d, scheduled_for=c_run.scheduled_for)
        assert d_run.state == RunState.SKIPPED
        assert d_run.skip_reason.startswith(f"upstream: job {c.id} run {c_run.id} ended skipped")
    for e_run in Run.objects.filter(job=e):
        first = a_runs[e_run.scheduled_for]
        assert e_run.state == RunState.SKIPPED
        assert e_run.skip_reason == (
            f"upstream: job {a.id} run {first.id} waited 1s (within_seconds) for {b.id}"
        )
    assert not Run.objects.filter(job=b).exists()
    assert not DependencyGate.objects.filter(state="waiting").exists()


def test_two_upstreams_ending_together_in_two_workers_make_one_dependent_run(stack, make_job):
    """A fan-in's two upstreams run in two worker processes and end on the same wall-clock
    tick, occurrence after occurrence, with two scheduler replicas applying the ends: one B
    run per instant, listing both upstream runs."""
    now = dt.datetime.now(dt.UTC)
    a1 = make_job(now=now, name="A1", task="tests.end_on_the_tick", **CRON_HEAD)
    a2 = make_job(now=now, name="A2", task="tests.end_on_the_tick", **CRON_HEAD)
    b = make_job(now=now, name="B", task="tests.record",
                 schedule={"kind": "after", "jobs": [str(a1.id), str(a2.id)]})  # fmt: skip
    minute = now.replace(second=0, microsecond=0)
    instants = backfill_occurrences(job=a1, start=minute - dt.timedelta(minutes=30), end=minute)
    for at in instants:  # A1's and A2's runs of an instant side by side in the queue
        for head in (a1, a2):
            assert job_backfill(job=head, instants=[at], actor=head.owner, now=now)
    stack.worker("w1", concurrency=1)  # both ready before anything is published
    stack.worker("w2", concurrency=1)
    stack.scheduler("scheduler-1")
    stack.scheduler("scheduler-2")
    stack.relay()

    def decided():
        return Run.objects.filter(job=b, state__in=["succeeded", "failed", "skipped"]).count()

    wait_for(lambda: decided() == 30, timeout=180, interval=0.5, message="30 B runs")
    time.sleep(1)  # nothing more comes
    heads = {(run.job_id, run.scheduled_for): run for run in Run.objects.filter(job__in=[a1, a2])}
    together = 0
    for run in Run.objects.filter(job=b):
        ends = [heads[(job.id, run.scheduled_for)] for job in (a1, a2)]
        assert run.state == RunState.SUCCEEDED
        assert sorted(upstream_of(run)) == sorted(end.id for end in ends)
        together += abs(ends[0].finished_at - ends[1].finished_at) < dt.timedelta(seconds=0.05)
    assert Run.objects.filter(job=b).count() == 30
    print(f"pairs of upstream ends within 50 ms of each other: {together} of 30")
    assert together >= 10  # the race was run, not just described
