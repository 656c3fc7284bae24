"""Tasks the test suite schedules. Each execution appends a line to the handler's own
record (SAMPLE_TASK_RECORD, a file), which the tests read to count executions."""

import datetime as dt
import json
import os
import time

from dispatch import job_task


def _record(ctx, event: str, **extra) -> None:
    path = os.environ.get("SAMPLE_TASK_RECORD")
    if not path:
        return
    line = json.dumps(
        {
            "event": event,
            "run_id": ctx.run_id,
            "attempt": ctx.attempt,
            "token": ctx.fencing_token,
            "at": time.time(),
            **extra,
        }
    )
    # O_APPEND writes of one short line are atomic between processes.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@job_task(name="tests.record")
def record(ctx, *args, **kwargs):
    _record(ctx, "executed", args=list(args), kwargs=kwargs)
    return {"ok": True, "args": list(args)}


@job_task(name="tests.end_on_the_tick")
def end_on_the_tick(ctx, tick=0.25):
    """Returns at the next multiple of `tick` seconds of wall time: two runs started by two
    workers within one tick of each other end at the same moment."""
    time.sleep(tick - time.time() % tick)
    _record(ctx, "executed")


@job_task(name="tests.fail")
def fail(ctx, message="boom"):
    _record(ctx, "executed")
    raise RuntimeError(message)


@job_task(name="tests.sleep")
def sleep(ctx, seconds=1.0):
    _record(ctx, "started")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not ctx.cancel_requested:
        time.sleep(0.05)
    _record(ctx, "executed")
    return {"slept": seconds}


@job_task(name="tests.record_packed", pack=20)
def record_packed(ctx, *args, **kwargs):
    """tests.record for short runs: up to 20 travel in one broker message."""
    _record(ctx, "executed", args=list(args), kwargs=kwargs)
    return {"ok": True, "args": list(args)}


@job_task(name="tests.fail_at")
def fail_at(ctx, instant=""):
    """tests.record, but raises for the run of the occurrence `instant` (ISO 8601)."""
    _record(ctx, "executed")
    if instant and ctx.scheduled_for == dt.datetime.fromisoformat(instant):
        raise RuntimeError(f"failing the occurrence {instant} on purpose")
    return {"ok": True}


@job_task(name="tests.record_alone", pack=1)
def record_alone(ctx, *args, **kwargs):
    """tests.record declared never to be packed."""
    _record(ctx, "executed", args=list(args), kwargs=kwargs)
    return {"ok": True, "args": list(args)}
