"""Run logs under faults, with real workers: a worker killed mid-run keeps what it shipped,
and a paused worker cannot add lines once its run was re-leased."""

import signal
import time

import pytest

from jobs.models import AttemptState, Counter, Run, RunState
from logs_app.models import LogChunk, LogManifest
from logs_app.store import chunk_lines
from tests.factories import one_time_job
from tests.faults.invariants import invariant_violations
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def lines_of(attempt) -> list[str]:
    texts = []
    for chunk in LogChunk.objects.filter(attempt=attempt).order_by("sequence"):
        texts += [line["text"] for line in chunk_lines(chunk)]
    return texts


def test_ten_thousand_lines_are_stored_in_order_and_complete(stack):
    stack.scheduler()
    stack.relay()
    stack.worker()
    job = one_time_job(task="faults.chatty", args=[10_000])
    run = wait_for(lambda: Run.objects.filter(job=job, state=RunState.SUCCEEDED).first(),
                   timeout=60, message="the chatty run to succeed")  # fmt: skip
    (attempt,) = run.attempts.all()
    texts = lines_of(attempt)
    assert texts == [f"attempt 1 line {index}" for index in range(10_000)]
    manifest = LogManifest.objects.get(attempt=attempt)
    assert manifest.line_count == 10_000 and manifest.dropped_lines == 0
    assert manifest.chunk_count == LogChunk.objects.filter(attempt=attempt).count()


def test_a_killed_worker_keeps_what_it_shipped_and_the_retry_is_complete(stack):
    stack.scheduler()
    stack.relay()
    stack.worker("doomed", concurrency=1)
    job = one_time_job(
        task="faults.chatty",
        args=[200, 1.0, True],
        heartbeat_timeout_seconds=2,
        retry={"max_attempts": 2, "initial_delay_seconds": 0, "jitter": False},
    )
    wait_for(lambda: any(e["event"] == "printed" for e in stack.executions()), timeout=30,
             message="attempt 1 to print its lines")  # fmt: skip
    first = Run.objects.get(job=job).attempts.get(number=1)
    wait_for(lambda: len(lines_of(first)) == 200, timeout=10,
             message="attempt 1's lines to be shipped")  # fmt: skip
    stack.kill("doomed")
    stack.worker("healthy", concurrency=1)

    run = wait_for(lambda: Run.objects.filter(job=job, state=RunState.SUCCEEDED).first(),
                   timeout=60, message="attempt 2 to succeed")  # fmt: skip
    first, second = run.attempts.order_by("number")
    assert first.state == AttemptState.LOST
    assert lines_of(first) == [f"attempt 1 line {index}" for index in range(200)]
    assert not LogManifest.objects.filter(attempt=first).exists()  # incomplete
    assert lines_of(second) == [f"attempt 2 line {index}" for index in range(200)]
    assert LogManifest.objects.get(attempt=second).line_count == 200  # complete
    assert invariant_violations() == []


def test_a_paused_worker_cannot_add_lines_after_its_run_was_re_leased(stack):
    stack.scheduler("scheduler", "--queued-after", "3", "--reconcile-interval", "1")
    stack.relay()
    stack.worker("paused", concurrency=1)
    job = one_time_job(
        task="faults.chatty",
        args=[60, 6.0],
        heartbeat_timeout_seconds=2,
        retry={"max_attempts": 3, "initial_delay_seconds": 0, "jitter": False},
    )
    wait_for(lambda: LogChunk.objects.filter(run__job=job).exists(), timeout=30,
             message="attempt 1 to ship a first chunk")  # fmt: skip
    stack.signal_group("paused", signal.SIGSTOP)
    first = Run.objects.get(job=job).attempts.get(number=1)
    shipped_before_pause = len(lines_of(first))
    stack.worker("healthy", concurrency=1)
    run = wait_for(lambda: Run.objects.filter(job=job, state=RunState.SUCCEEDED).first(),
                   timeout=60, message="the run to succeed elsewhere")  # fmt: skip
    stack.signal_group("paused", signal.SIGCONT)
    # The resumed handler prints its remaining lines and tries to ship them and to finish.
    wait_for(
        lambda: Counter.objects.filter(
            name="scheduler_stale_completions_total", labels='kind="completion"'
        ).exists(),
        timeout=30,
        message="the resumed attempt's completion to be refused",
    )
    time.sleep(2)  # two more shipping intervals
    first.refresh_from_db()
    assert first.state == AttemptState.LOST
    assert len(lines_of(first)) == shipped_before_pause < 60
    assert not LogManifest.objects.filter(attempt=first).exists()
    second = run.attempts.get(number=2)
    assert len(lines_of(second)) == 60 and LogManifest.objects.filter(attempt=second).exists()
