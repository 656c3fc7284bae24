"""Time limits: Celery's soft limit for each run of a packed message (SIGALRM), and the
room a packed message's hard limit leaves each run."""

from __future__ import annotations

import contextlib
import signal
import threading

from celery.exceptions import SoftTimeLimitExceeded

from .outage import COMPLETION_RETRY_SECONDS

# Seconds between Celery's soft time limit (the handler gets SoftTimeLimitExceeded) and its
# hard one (the pool process is killed; the reaper then records the attempt timed out).
HARD_TIME_LIMIT_GRACE = 15
# The room a packed message's hard limit gives each run beyond its own limit (its grace,
# and the claim's and the outcome's retries through an outage; dispatch.relay): a reserved
# run's deadline leaves it to every run before it.
PACK_RUN_GRACE_SECONDS = HARD_TIME_LIMIT_GRACE + int(2 * COMPLETION_RETRY_SECONDS)


def enforces_time_limits() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


@contextlib.contextmanager
def soft_time_limit(seconds: float | None):
    """Celery's soft time limit for one run inside a packed message: SIGALRM raises
    SoftTimeLimitExceeded in the handler, as the pool's own limit would. Only in the main
    thread of a process that has the signal (prefork, solo); elsewhere the reaper's
    `deadline_at` is the limit, as for the pools that cannot enforce Celery's."""
    if not seconds or not enforces_time_limits():
        yield
        return

    def expire(signum, frame):
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
