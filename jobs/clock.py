"""The database's clock: leases, due times and heartbeats are compared with it, so a
process whose own clock is skewed neither steals nor loses work. Each process measures its
own skew against it (`clock_skew_record`), exported as `scheduler_clock_skew_seconds`."""

import datetime as dt
import os
import socket
import time

from storage.clock import clock_now

from .models import ProcessClock

# A process's row not measured again for this long is a process gone: not exported any
# more, and deleted by the next measurement of any process.
CLOCK_SKEW_EXPIRY = dt.timedelta(seconds=60)
SKEW_SAMPLES = 3  # round trips per measurement; the shortest is the most precise


def db_now() -> dt.datetime:
    return clock_now()


def request_clock_keep(request, now: dt.datetime) -> None:
    """Keep the database's clock as a statement of `request` read it (its throttle's), for
    request_now."""
    request._scheduler_db_now = now


def request_now(request) -> dt.datetime:
    """The database's clock for a request's work: the reading its throttle's statement took
    (a few statements earlier in the same request, never a web process's own clock), or a
    round trip when it was not throttled. A creation is dated, and its first fire computed,
    at that instant."""
    now = getattr(request, "_scheduler_db_now", None)
    return now if now is not None else db_now()


def clock_skew_measure() -> tuple[float, dt.datetime]:
    """(this process's clock minus the database's, in seconds; the database's now): the
    database's clock against the midpoint of the round trip that read it, over the shortest
    of a few round trips, so the error is at most half of that trip."""
    best = None
    for _ in range(SKEW_SAMPLES):
        sent = time.time()
        database = clock_now()
        received = time.time()
        if best is None or received - sent < best[0]:
            best = (received - sent, (sent + received) / 2 - database.timestamp(), database)
    return best[1], best[2]


def clock_skew_record(*, kind: str, name: str = "") -> float:
    """Measure this process's skew and record it under (host, pid, kind); delete the rows of
    processes gone (not measured within CLOCK_SKEW_EXPIRY). Returns the skew."""
    skew, now = clock_skew_measure()
    ProcessClock.objects.bulk_create(
        [ProcessClock(host=socket.gethostname(), pid=os.getpid(), kind=kind, name=name,
                      skew_seconds=skew, measured_at=now)],
        update_conflicts=True,
        unique_fields=["host", "pid", "kind"],
        update_fields=["name", "skew_seconds", "measured_at"],
    )  # fmt: skip
    ProcessClock.objects.filter(measured_at__lt=now - CLOCK_SKEW_EXPIRY).delete()
    return skew
