"""Replicas race: two schedulers and two relays over a burst, and a relay killed between
the broker's confirm and the commit that deletes its outbox rows."""

import datetime as dt
import signal
import statistics

import pytest
from django.contrib.auth import get_user_model

from jobs.models import Counter, Job, OutboxMessage, OutboxState, Run, RunState
from tests import factories
from tests.processes import wait_for

pytestmark = pytest.mark.slow
BURST = 500


def test_two_schedulers_two_relays_burst_of_500_runs_each_once(stack, report_figure):
    owner = get_user_model().objects.create_user("burst")
    now = dt.datetime.now(dt.UTC)
    due = (now + dt.timedelta(seconds=10)).replace(microsecond=0)
    for index in range(BURST):
        factories.make_job(
            owner,
            now=now,
            name=f"burst {index}",
            task="tests.record",
            schedule={"kind": "once", "run_at": due.isoformat()},
        )
    assert Job.objects.filter(next_run_at=due).count() == BURST

    for name in ("scheduler-a", "scheduler-b"):
        stack.scheduler(name, "--batch-size", "100")
    for name in ("relay-a", "relay-b"):
        stack.relay(name, "--batch-size", "50")
    stack.worker("worker-a", concurrency=2)
    stack.worker("worker-b", concurrency=2)

    wait_for(
        lambda: Run.objects.filter(state=RunState.SUCCEEDED).count() == BURST,
        timeout=120,
        interval=0.5,
        message=f"{BURST} runs to succeed",
    )
    assert Run.objects.count() == BURST
    assert Run.objects.values("job_id").distinct().count() == BURST
    executions = stack.executions()
    assert len(executions) == BURST
    assert len({e["run_id"] for e in executions}) == BURST
    assert not OutboxMessage.objects.exists()  # every row deleted once confirmed
    # Both replicas of each kind took part (SKIP LOCKED split the work between them).
    for name in ("scheduler-a", "scheduler-b", "relay-a", "relay-b"):
        assert stack.processes[name].poll() is None, stack.log(name)[-2000:]

    runs = list(Run.objects.all())
    lateness = sorted((r.started_at - r.due_at).total_seconds() for r in runs)
    discovery = sorted((r.created_at - r.due_at).total_seconds() for r in runs)
    report_figure(
        f"{BURST} one-time jobs due at one second: start lateness p50 "
        f"{statistics.median(lateness):.2f}s, p99 {lateness[int(0.99 * BURST) - 1]:.2f}s, "
        f"last {lateness[-1]:.2f}s; discovery lag max {discovery[-1]:.2f}s"
    )


def test_relay_killed_after_confirm_duplicate_refused_and_counted(stack, make_job):
    run_at = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)).isoformat()
    job = make_job(task="tests.record", schedule={"kind": "once", "run_at": run_at})
    stack.scheduler()
    # Its claim on the row lasts 16 s (the shortest above the confirm wait): then another
    # relay publishes the row again.
    crashing = stack.relay(
        "relay-crashing", "--claim-lease", "16", SCHEDULER_FAILPOINTS="relay.after_confirm"
    )
    crashing.wait(timeout=60)
    assert crashing.returncode == -signal.SIGKILL, stack.log("relay-crashing").decode()[-3000:]
    # The broker confirmed the message, but the row was never deleted.
    message = OutboxMessage.objects.get(run__job=job)
    assert message.state == OutboxState.PENDING

    stack.relay("relay")
    stack.worker()
    run = wait_for(
        lambda: Run.objects.filter(job=job, state=RunState.SUCCEEDED).first(),
        timeout=60,
        message="the run to succeed",
    )
    wait_for(
        lambda: Run.objects.get(id=run.id).duplicate_deliveries == 1,
        timeout=60,
        message="the duplicate delivery to be refused",
    )
    assert not OutboxMessage.objects.filter(id=message.id).exists()
    assert run.attempts.count() == 1
    assert [e["run_id"] for e in stack.executions()] == [str(run.id)]
    assert Counter.objects.get(name="scheduler_duplicate_deliveries_total").value == 1
