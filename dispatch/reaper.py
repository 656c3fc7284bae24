"""The reaper: ends attempts whose worker stopped renewing the lease, or that overran their
timeout, and retries or fails their runs by the job's policy.

`reaper_run_once` reads a batch of expired attempts and ends each in its own short
transaction, by the same fenced conditional update a worker's own completion uses: when
two reapers (or a reaper and a late worker) race for one attempt, exactly one wins and the
other changes nothing. No lock is held across the batch, so a cancel or a completion of
another attempt never waits for (or deadlocks against) a whole reaper batch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging

from django.db.models import Q

from jobs.models import Attempt, AttemptState
from jobs.retry import CAUSE_LOST, CAUSE_TIMEOUT
from jobs.services import attempt_record_failure

from .relay import HARD_TIME_LIMIT_GRACE

log = logging.getLogger("dispatch.reaper")


@dataclasses.dataclass(frozen=True)
class ReaperConfig:
    batch_size: int = 200
    poll_interval: float = 1.0
    # After its deadline, the worker's own soft and hard time limits get this long to end
    # the attempt; past it the reaper ends it (a pool that cannot enforce limits).
    deadline_grace_seconds: float = HARD_TIME_LIMIT_GRACE + 15


@dataclasses.dataclass(frozen=True)
class ReaperResult:
    lost: int
    timed_out: int
    batch_full: bool


def reaper_run_once(*, now: dt.datetime, config: ReaperConfig) -> ReaperResult:
    lost = timed_out = 0
    overdue = Q(deadline_at__lt=now - dt.timedelta(seconds=config.deadline_grace_seconds))
    expired = Q(lease_expires_at__lt=now) | overdue
    attempts = list(
        Attempt.objects.select_related("run__job_version")
        .filter(state=AttemptState.RUNNING)
        .filter(expired)
        .order_by("lease_expires_at")[: config.batch_size]
    )
    for attempt in attempts:
        # Past its deadline the attempt timed out, whether or not its worker still lives.
        cause = (
            CAUSE_TIMEOUT
            if attempt.deadline_at is not None and attempt.deadline_at <= now
            else CAUSE_LOST
        )
        run = attempt.run
        outcome = attempt_record_failure(
            attempt=attempt,
            spec=run.job_version.spec,
            retry_base=run.retry_base,
            cause=cause,
            error=(
                f"lease expired at {attempt.lease_expires_at.isoformat()}"
                if cause == CAUSE_LOST
                else f"ran past its deadline {attempt.deadline_at.isoformat()}"
            ),
            now=now,
            by="reaper",
            # Still expired when ended: a lease renewed since the read above wins.
            only_if=expired,
        )
        if outcome is None:
            continue
        log.warning(
            "attempt %s of run %s %s; run is now %s",
            attempt.number,
            run.id,
            "timed out" if cause == CAUSE_TIMEOUT else "lost its lease",
            outcome,
        )
        if cause == CAUSE_TIMEOUT:
            timed_out += 1
        else:
            lost += 1
    return ReaperResult(
        lost=lost, timed_out=timed_out, batch_full=len(attempts) >= config.batch_size
    )
