"""Overlap policies with real processes: a handler that outlasts its job's interval."""

import datetime as dt
import time

import pytest

from jobs.models import Job, Run, RunState
from jobs.services import job_pause
from tests.factories import make_job, owner
from tests.processes import wait_for

pytestmark = pytest.mark.slow


def overlapping(runs: list[Run]) -> list[tuple]:
    """Pairs of runs of the job whose executions overlapped in time."""
    spans = sorted((r.started_at, r.finished_at, r.id) for r in runs if r.started_at)
    return [(a[2], b[2]) for a, b in zip(spans, spans[1:], strict=False) if a[1] and b[0] < a[1]]


@pytest.mark.parametrize("policy", ["skip", "buffer_one", "cancel_previous", "allow"])
def test_a_handler_that_outlasts_the_interval(stack, policy, report_figure):
    stack.scheduler()
    stack.relay()
    stack.worker(concurrency=2)
    now = dt.datetime.now(dt.UTC)
    job = make_job(
        owner(),
        now=now,
        name=f"overlap {policy}",
        task="tests.sleep",
        kwargs={"seconds": 3.5},
        schedule={"kind": "interval", "every_seconds": 2},
        start_at=(now + dt.timedelta(seconds=2)).isoformat(),
        overlap=policy,
        heartbeat_timeout_seconds=3,
    )
    time.sleep(10)  # five occurrences
    assert job_pause(job=Job.objects.get(id=job.id), actor=owner(), now=dt.datetime.now(dt.UTC))
    wait_for(
        lambda: (
            not Run.objects.filter(
                job=job, state__in=[RunState.QUEUED, RunState.RUNNING, RunState.PENDING]
            ).exists()
        ),
        timeout=30,
        message="the job's runs to finish",
    )
    runs = list(Run.objects.filter(job=job).order_by("scheduled_for"))
    states = [r.state for r in runs]
    assert len(runs) >= 4, states
    # One run per occurrence, every occurrence accounted for.
    assert len({r.scheduled_for for r in runs}) == len(runs)
    skipped = [r for r in runs if r.state == RunState.SKIPPED]
    cancelled = [r for r in runs if r.state == RunState.CANCELLED]
    if policy == "allow":
        assert set(states) == {RunState.SUCCEEDED}
        assert overlapping(runs)  # the handler outlasts the interval: they did overlap
    elif policy == "skip":
        assert skipped and all(r.skip_reason for r in skipped)
        assert not overlapping(runs)
    elif policy == "buffer_one":
        assert skipped and all(r.skip_reason for r in skipped)
        assert not overlapping(runs)
        # A buffered run started well after its occurrence: it waited for the active one.
        assert any(
            (r.started_at - r.scheduled_for).total_seconds() > 1
            for r in runs
            if r.state == RunState.SUCCEEDED
        )
    else:  # cancel_previous
        assert cancelled and not skipped
        assert all(a.state == "cancelled" for r in cancelled for a in r.attempts.all())
    report_figure(f"overlap {policy}: {states}")
