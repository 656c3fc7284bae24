"""Recording an outcome through a database outage: bounded retries, and a claim retried
after an ambiguous commit adopts what its first try may have made."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from django.db import InterfaceError, OperationalError, connection

T = TypeVar("T")
log = logging.getLogger("dispatch.worker")
# How long a finished attempt keeps trying to record its outcome while the database is down.
COMPLETION_RETRY_SECONDS = 60.0


def with_database_retries(write: Callable[[], T]) -> T:
    """Record an outcome through a database outage, for a bounded time."""
    deadline = time.monotonic() + COMPLETION_RETRY_SECONDS
    delay = 0.2
    while True:
        try:
            return write()
        except SoftTimeLimitExceeded:
            # Celery's soft limit landed during the write itself: the outcome is known, so
            # record it anyway (the hard limit, 15 s later, still bounds the process).
            log.warning("the soft time limit interrupted recording an outcome; retrying")
            continue
        except (OperationalError, InterfaceError):  # the database is unreachable, not the data
            if time.monotonic() > deadline:
                raise
            log.warning("recording an outcome failed; retrying in %.1fs", delay, exc_info=True)
            connection.close()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def adopting(claim: Callable[[uuid.UUID], T], adopt: Callable[[uuid.UUID], T]) -> T:
    """`claim(claim_id)` retried through a database outage for a bounded time (the claim's
    id is one for all tries); a retry after an ambiguous commit first adopts what the
    first try may have made (`adopt(claim_id)`, falsy when it made nothing)."""
    claim_id = uuid.uuid4()
    tries = 0

    def attempt() -> T:
        nonlocal tries
        tries += 1
        if tries > 1 and (mine := adopt(claim_id)):
            return mine
        return claim(claim_id)

    return with_database_retries(attempt)
