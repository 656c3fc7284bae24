"""Each process stops cleanly on SIGTERM, finishing the work in hand."""

import datetime as dt
import signal
import time

import pytest

from jobs.models import Run, RunState
from tests.processes import wait_for

pytestmark = pytest.mark.slow


def test_sigterm_stops_scheduler_relay_and_worker_cleanly(stack, make_job):
    stack.scheduler()
    stack.relay()
    stack.worker()
    run_at = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.5)).isoformat()
    job = make_job(
        task="tests.sleep", kwargs={"seconds": 3}, schedule={"kind": "once", "run_at": run_at}
    )
    wait_for(
        lambda: any(e["event"] == "started" for e in stack.executions()),
        timeout=30,
        message="the handler to start",
    )
    started = time.monotonic()
    codes = {
        name: stack.stop(name, signal.SIGTERM, timeout=30)
        for name in ("worker", "scheduler", "relay")
    }
    assert codes == {"worker": 0, "scheduler": 0, "relay": 0}
    # The worker's warm shutdown let the running handler finish and record its outcome.
    assert time.monotonic() - started < 30
    assert Run.objects.get(job=job).state == RunState.SUCCEEDED
    assert [e["event"] for e in stack.executions()] == ["started", "executed"]
