"""Packed runs under faults: a worker SIGKILLed in the middle of a pack whose runs were
reserved together, and a poison run inside a pack. Nothing is lost, nothing is doubled
beyond the one run that may have been running, and only that run is charged."""

import datetime as dt

import pytest

from jobs.models import Attempt, AttemptState, FailureReason, Run, RunState
from jobs.transitions import RELEASED_ERROR as RELEASED
from tests.factories import one_time_job
from tests.faults.invariants import invariant_violations
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _charged(run) -> list[Attempt]:
    """The run's attempts that counted against its budget (released ones do not)."""
    return [a for a in run.attempts.order_by("number") if RELEASED not in a.error]


def test_a_worker_killed_mid_pack_loses_nothing_and_charges_one_run_per_kill(stack):
    stack.scheduler("scheduler", "--queued-after", "5", "--reconcile-interval", "1")
    stack.relay()
    stack.worker(concurrency=1)
    # Due together, after all are made: materialized in one pass, published as full packs.
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
    jobs = [
        one_time_job(task="faults.packed_work", due_at=due, args=[0.2], heartbeat_timeout_seconds=2,
                     retry={"max_attempts": 2, "initial_delay_seconds": 0, "jitter": False})
        for _ in range(20)
    ]  # fmt: skip
    # Kill the worker while a pack is under way with reserved runs still waiting their turn.
    waiting = Attempt.objects.filter(state=AttemptState.RUNNING, started_at__isnull=True)
    wait_for(lambda: any(e["event"] == "executed" for e in stack.executions())
             and waiting.count() >= 4,
             timeout=60, message="a pack under way with reserved runs waiting")  # fmt: skip
    stack.kill("worker")
    stack.restart("worker")

    wait_for(lambda: Run.objects.filter(job__in=jobs, state=RunState.SUCCEEDED).count() == 20,
             timeout=120, message="every packed run to succeed")  # fmt: skip
    runs = list(Run.objects.filter(job__in=jobs))
    charged_lost = [run for run in runs if any(a.state == AttemptState.LOST for a in _charged(run))]
    assert len(charged_lost) <= 1, [(_charged(run), run.id) for run in charged_lost]
    released = Attempt.objects.filter(run__in=runs, error__contains=RELEASED)
    assert released.exists(), "the pack's runs not reached were released"
    assert all(a.state == AttemptState.LOST and a.started_at is None for a in released)
    for run in runs:
        assert run.attempt_count - run.retry_base == len(_charged(run)) <= 2
    assert invariant_violations() == []


def test_a_poison_run_in_a_pack_fails_after_its_budget_and_its_pack_mates_succeed(stack):
    stack.scheduler("scheduler", "--queued-after", "5", "--reconcile-interval", "1")
    stack.relay()
    stack.worker(concurrency=1)
    retry = {"max_attempts": 2, "initial_delay_seconds": 0, "jitter": False}
    kinds = ["ok"] * 3 + ["poison"] + ["ok"] * 4
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
    jobs = [
        one_time_job(task="faults.packed_poison", due_at=due, args=[kind],
                     heartbeat_timeout_seconds=2, retry=retry)
        for kind in kinds
    ]  # fmt: skip
    poison = jobs[3]

    run = wait_for(lambda: Run.objects.filter(job=poison, state=RunState.FAILED).first(),
                   timeout=120, message="the poison run to fail")  # fmt: skip
    assert run.failure_reason == FailureReason.LOST
    assert len(_charged(run)) == 2
    # At most one uncharged try before its budget: the kill of the pack it was reserved in.
    starts = [e for e in stack.executions() if e["event"] == "started"
              and e["run_id"] == str(run.id)]  # fmt: skip
    assert 2 <= len(starts) <= 3
    mates = [job for job in jobs if job is not poison]
    wait_for(lambda: Run.objects.filter(job__in=mates, state=RunState.SUCCEEDED).count() == 7,
             timeout=60, message="the poison run's pack-mates to succeed")  # fmt: skip
    assert invariant_violations() == []
    # The worker survived its pool process's deaths.
    assert stack.processes["worker"].poll() is None
