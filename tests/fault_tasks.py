"""Tasks the fault-injection suite schedules. Like tests.sample_tasks, each writes lines to
the handler's own record file; the ledger effects also bump a per-run durable counter in
the effect's transaction, so that the invariant checker can count committed effects."""

import os
import signal
import threading
import time

from dispatch import job_task
from jobs.counters import counter_increment
from tests.sample_tasks import _record

EFFECT_COUNTER = "test_effect_commits"


def effect_labels(run_id) -> str:
    return f'run="{run_id}"'


def _commit_effect(ctx, name: str) -> bool:
    """The ledger effect: the counter row commits with the ledger row, or not at all."""
    with ctx.effect(name) as effect:
        if effect.done:
            return False
        counter_increment(EFFECT_COUNTER, labels=effect_labels(ctx.run_id))
    _record(ctx, "effect", name=name)
    return True


def _busy(ctx, seconds: float, *, heartbeat: bool) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if heartbeat:
            ctx.heartbeat()
        time.sleep(0.1)


@job_task(name="faults.work")
def work(ctx, seconds=0.3):
    """Works a while, commits one ledger effect, returns."""
    _record(ctx, "started", pid=os.getpid())
    _busy(ctx, seconds, heartbeat=True)
    _commit_effect(ctx, "work")
    _record(ctx, "executed")
    return {"ok": True}


@job_task(name="faults.wait")
def wait(ctx, seconds=5.0):
    """Waits, heartbeating every second, on an Event rather than time.sleep: under
    libfaketime with the monotonic clock left real, time.sleep fails (EINVAL from its
    clock_nanosleep), and faking the monotonic clock too hangs Event waits."""
    _record(ctx, "started", pid=os.getpid())
    pause = threading.Event()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctx.heartbeat()
        pause.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    _record(ctx, "executed")
    return {"waited": seconds}


@job_task(name="faults.oblivious")
def oblivious(ctx, seconds=5.0):
    """Works without looking at cancel_requested (a handler deep in a call), then sends a
    heartbeat and commits its effect."""
    _record(ctx, "started", pid=os.getpid())
    _busy(ctx, seconds, heartbeat=False)
    _record(ctx, "heartbeat", alive=ctx.heartbeat())
    _commit_effect(ctx, "work")
    _record(ctx, "executed")
    return {"ok": True}


@job_task(name="faults.poison")
def poison(ctx):
    """Kills its own worker process every time, as a segfaulting C extension would."""
    _record(ctx, "started", pid=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


@job_task(name="faults.until_cancelled")
def until_cancelled(ctx, limit=60.0):
    """Heartbeats until the run is cancelled, then tries its effect anyway."""
    _record(ctx, "started", pid=os.getpid())
    deadline = time.monotonic() + limit
    while not ctx.cancel_requested and time.monotonic() < deadline:
        ctx.heartbeat()
        time.sleep(0.1)
    _record(ctx, "saw_cancel", cancel_requested=ctx.cancel_requested)
    _commit_effect(ctx, "work")
    return {"ok": True}


@job_task(name="faults.overrun")
def overrun(ctx, seconds=30.0):
    """Runs past its timeout, heartbeating, unless stopped."""
    _record(ctx, "started", pid=os.getpid())
    _busy(ctx, seconds, heartbeat=True)
    _record(ctx, "executed")
    return {"ok": True}


@job_task(name="faults.fail_first")
def fail_first(ctx):
    """Fails its first attempt, succeeds on any later one (a replay)."""
    _record(ctx, "started", pid=os.getpid())
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    _commit_effect(ctx, "work")
    _record(ctx, "executed")
    return {"attempt": ctx.attempt}


@job_task(name="faults.chatty")
def chatty(ctx, lines=100, seconds=0.0, crash_first=False):
    """Prints `lines` numbered lines spread over `seconds`, then commits its effect; with
    `crash_first`, the first attempt records how far it got and waits to be killed."""
    _record(ctx, "started", pid=os.getpid())
    pause = seconds / lines if lines else 0
    for index in range(lines):
        print(f"attempt {ctx.attempt} line {index}")
        if pause:
            time.sleep(pause)
    if crash_first and ctx.attempt == 1:
        _record(ctx, "printed")
        time.sleep(3600)  # until the test kills the worker
    _commit_effect(ctx, "work")
    _record(ctx, "executed")
    return {"lines": lines}


@job_task(name="faults.packed_work", pack=10)
def packed_work(ctx, seconds=0.2):
    """faults.work for short runs: up to 10 travel in one message, reserved together."""
    _record(ctx, "started", pid=os.getpid())
    time.sleep(seconds)
    _commit_effect(ctx, "work")
    _record(ctx, "executed")
    return {"ok": True}


@job_task(name="faults.packed_poison", pack=10)
def packed_poison(ctx, kind="ok"):
    """A pack's run that kills its worker process every time when `kind` is "poison"."""
    _record(ctx, "started", pid=os.getpid())
    if kind == "poison":
        os.kill(os.getpid(), signal.SIGKILL)
    _commit_effect(ctx, "work")
    _record(ctx, "executed")
    return {"ok": True}
