"""A worker paused past its lease: the run is re-leased and finished elsewhere, and the
paused worker, once resumed, can change nothing."""

import signal

import pytest

from jobs.models import AttemptState, AuditEvent, Effect, Run, RunState
from tests.factories import one_time_job
from tests.fault_tasks import EFFECT_COUNTER, effect_labels
from tests.faults.helpers import counter
from tests.faults.invariants import invariant_violations
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def test_sigstopped_worker_is_fenced_after_its_run_is_re_leased(stack):
    # The paused worker still holds a prefetch slot, so the broker may hand it the retry's
    # message too: reconciliation publishes that one again after 3 s.
    stack.scheduler("scheduler", "--queued-after", "3", "--reconcile-interval", "1")
    stack.relay()
    stack.worker("paused", concurrency=1)
    job = one_time_job(
        task="faults.oblivious",
        args=[4.0],
        heartbeat_timeout_seconds=2,
        retry={"max_attempts": 3, "initial_delay_seconds": 0, "jitter": False},
    )
    wait_for(lambda: any(e["event"] == "started" for e in stack.executions()), timeout=30,
             message="attempt 1 to start")  # fmt: skip
    stack.signal_group("paused", signal.SIGSTOP)
    stack.worker("healthy", concurrency=1)

    run = Run.objects.get(job=job)
    wait_for(lambda: Run.objects.get(id=run.id).state == RunState.SUCCEEDED, timeout=60,
             message="the run to succeed on the healthy worker")  # fmt: skip
    stack.signal_group("paused", signal.SIGCONT)
    wait_for(
        lambda: counter("scheduler_stale_completions_total", 'kind="completion"') >= 1,
        timeout=30,
        message="the resumed worker's completion to be refused",
    )

    run.refresh_from_db()
    first, second = run.attempts.order_by("number")
    assert (first.state, first.fencing_token) == (AttemptState.LOST, 1)
    assert (second.state, second.fencing_token) == (AttemptState.SUCCEEDED, 2)
    assert run.fencing_token == 2
    # The resumed worker's effect was refused; the only effect is attempt 2's.
    effect = Effect.objects.get(run=run, name="work")
    assert (effect.attempt_number, effect.fencing_token) == (2, 2)
    assert counter(EFFECT_COUNTER, effect_labels(run.id)) == 1
    assert counter("scheduler_stale_completions_total", 'kind="effect"') >= 1
    assert counter("scheduler_stale_completions_total", 'kind="heartbeat"') >= 1
    assert counter("scheduler_lease_expired_total") == 1
    assert AuditEvent.objects.filter(run=run, action="attempt.lost").count() == 1
    effects_by_attempt = [e["attempt"] for e in stack.executions() if e["event"] == "effect"]
    assert effects_by_attempt == [2]
    heartbeats = [
        (e["attempt"], e["alive"]) for e in stack.executions() if e["event"] == "heartbeat"
    ]
    assert sorted(heartbeats) == [(1, False), (2, True)]
    assert invariant_violations() == []
