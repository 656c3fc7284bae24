"""Recovery paths with real processes: a message lost in the broker, a worker killed
between a delivery's acknowledgement and its claim, a poison job, a run that overruns its
timeout, and a run longer than RabbitMQ's consumer timeout."""

import signal
import subprocess

import pytest

from jobs.models import AttemptState, AuditEvent, FailureReason, OutboxMessage, Run, RunState
from tests.factories import one_time_job
from tests.faults.helpers import counter, restarts_services
from tests.faults.invariants import invariant_violations
from tests.processes import purge_queue, queue_ready_messages, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def test_message_purged_from_the_queue_is_republished_and_runs(stack):
    stack.scheduler("scheduler", "--queued-after", "2", "--reconcile-interval", "1")
    stack.relay()
    job = one_time_job(task="faults.work")
    # A confirmed message's outbox row is deleted.
    wait_for(lambda: Run.objects.filter(job=job).exists()
             and not OutboxMessage.objects.filter(run__job=job).exists(),
             timeout=30, message="the run's message to be published")  # fmt: skip
    purge_queue()  # the message is lost inside the broker
    stack.worker()

    run = wait_for(lambda: Run.objects.filter(job=job, state=RunState.SUCCEEDED).first(),
                   timeout=60, message="the republished run to succeed")  # fmt: skip
    assert run.republish_count == 1
    assert not OutboxMessage.objects.filter(run=run).exists()  # both confirmed, deleted
    assert AuditEvent.objects.filter(run=run, action="run.republished").count() == 1
    assert counter("scheduler_reconcile_repairs_total", 'kind="republished"') == 1
    assert [e["attempt"] for e in stack.executions() if e["event"] == "executed"] == [1]
    assert invariant_violations() == []


def test_worker_killed_between_the_ack_and_the_claim_is_republished(stack):
    # The soak's worker SIGKILLs that landed in this gap left runs queued with no outbox
    # row and no message until reconciliation, `--queued-after` later.
    stack.scheduler()
    stack.relay()
    stack.worker("worker-dying", concurrency=1, SCHEDULER_FAILPOINTS="worker.before_claim")
    job = one_time_job(task="faults.work")
    wait_for(lambda: b"SIGKILL" in stack.log("worker-dying"), timeout=60,
             message="the pool process to die before its claim")  # fmt: skip
    stack.kill("worker-dying")
    run = Run.objects.get(job=job)
    # Acknowledged early: not in the broker, not in the outbox, never claimed.
    assert (run.state, run.attempt_count) == (RunState.QUEUED, 0)
    assert not OutboxMessage.objects.filter(run=run).exists()
    assert queue_ready_messages("jobs") == 0

    stack.stop("scheduler", signal.SIGTERM)
    stack.scheduler("reconciling", "--queued-after", "2", "--reconcile-interval", "1")
    stack.worker()
    run = wait_for(lambda: Run.objects.filter(job=job, state=RunState.SUCCEEDED).first(),
                   timeout=60, message="the republished run to succeed")  # fmt: skip
    assert run.republish_count == 1
    event = AuditEvent.objects.get(run=run, action="run.republished")
    assert event.data["lost_because"] == "queue_idle"
    assert [e["attempt"] for e in stack.executions() if e["event"] == "executed"] == [1]
    assert invariant_violations() == []


def test_poison_job_fails_after_its_attempt_budget(stack):
    stack.scheduler()
    stack.relay()
    stack.worker(concurrency=1)
    job = one_time_job(
        task="faults.poison",
        heartbeat_timeout_seconds=2,
        retry={"max_attempts": 3, "initial_delay_seconds": 0, "jitter": False},
    )
    run = wait_for(lambda: Run.objects.filter(job=job, state=RunState.FAILED).first(),
                   timeout=90, message="the poison run to fail")  # fmt: skip
    assert run.failure_reason == FailureReason.LOST
    assert [a.state for a in run.attempts.order_by("number")] == [AttemptState.LOST] * 3
    assert len([e for e in stack.executions() if e["event"] == "started"]) == 3
    # The worker survived its pool processes' deaths and still runs other work.
    ok = one_time_job(task="faults.work")
    wait_for(lambda: Run.objects.filter(job=ok, state=RunState.SUCCEEDED).exists(),
             timeout=30, message="a healthy job on the same worker")  # fmt: skip


def test_overrunning_handler_is_stopped_and_the_run_fails_with_timeout(stack):
    stack.scheduler()
    stack.relay()
    stack.worker(concurrency=1)
    job = one_time_job(
        task="faults.overrun", args=[60], timeout_seconds=2, retry={"max_attempts": 1}
    )
    run = wait_for(lambda: Run.objects.filter(job=job, state=RunState.FAILED).first(),
                   timeout=60, message="the overrunning run to fail")  # fmt: skip
    assert run.failure_reason == FailureReason.TIMEOUT
    (attempt,) = run.attempts.all()
    assert attempt.state == AttemptState.TIMED_OUT
    assert "SoftTimeLimitExceeded" in attempt.error  # stopped by the worker, not the reaper
    assert (attempt.finished_at - attempt.started_at).total_seconds() < 10
    assert not [e for e in stack.executions() if e["event"] == "executed"]


def _set_consumer_timeout(milliseconds: int) -> None:
    subprocess.run(
        ["rabbitmqctl", "eval", f"application:set_env(rabbit, consumer_timeout, {milliseconds})."],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


@restarts_services  # sets the machine's RabbitMQ-wide consumer_timeout
def test_run_longer_than_the_consumer_timeout_finishes_once(stack, report_figure):
    # RabbitMQ 3.10 has only the global setting, and checks it once a minute: a run of 75 s
    # against a 5 s timeout would lose its channel if it held its delivery unacknowledged.
    _set_consumer_timeout(5000)
    try:
        stack.scheduler()
        stack.relay()
        stack.worker(concurrency=1)
        job = one_time_job(task="faults.work", args=[75], timeout_seconds=300)
        run = wait_for(lambda: Run.objects.filter(job=job).exclude(
            state__in=[RunState.QUEUED, RunState.RUNNING]).first(),
            timeout=150, interval=1, message="the long run to finish")  # fmt: skip
        after = one_time_job(task="faults.work")
        wait_for(lambda: Run.objects.filter(job=after, state=RunState.SUCCEEDED).exists(),
                 timeout=30, message="the next run on the same worker")  # fmt: skip
    finally:
        _set_consumer_timeout(1_800_000)
    assert run.state == RunState.SUCCEEDED
    assert run.attempt_count == 1 and run.duplicate_deliveries == 0
    assert len([e for e in stack.executions() if e["event"] == "started"]) == 2
    log = stack.log("worker")
    assert b"PRECONDITION_FAILED" not in log and b"Connection to broker lost" not in log
    report_figure(
        f"run of {(run.finished_at - run.started_at).total_seconds():.0f}s against a 5 s "
        "consumer timeout: one attempt, worker connection kept"
    )
    assert invariant_violations() == []
