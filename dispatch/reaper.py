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
import time

from django.db import OperationalError, transaction
from django.db.models import Q

from jobs.models import Attempt, AttemptState
from jobs.outcomes import Failure, attempts_record_failure
from jobs.services import attempt_release_unstarted
from jobs.transitions import attempt_abandon
from storage.attempts import lock_timeout_set_local

from .config import config_require
from .failpoints import failpoint
from .worker.limits import HARD_TIME_LIMIT_GRACE

log = logging.getLogger("dispatch.reaper")


@dataclasses.dataclass(frozen=True)
class ReaperConfig:
    batch_size: int = 200
    poll_interval: float = 1.0
    # After its deadline, the worker's own soft and hard time limits get this long to end
    # the attempt; past it the reaper ends it (a pool that cannot enforce limits).
    deadline_grace_seconds: float = HARD_TIME_LIMIT_GRACE + 15
    # How long ending one attempt may wait for its run's row lock before moving on.
    lock_timeout_seconds: float = 2.0
    # After the database was unreachable, reap nothing until it has answered this long:
    # workers' lease keepers need the time to renew leases that lapsed during the outage.
    recovery_grace_seconds: float = 5.0

    def __post_init__(self) -> None:
        config_require(
            self,
            at_least_one=("batch_size",),
            positive=("poll_interval", "lock_timeout_seconds"),
            non_negative=("deadline_grace_seconds", "recovery_grace_seconds"),
        )


@dataclasses.dataclass(frozen=True)
class ReaperResult:
    lost: int
    timed_out: int
    batch_full: bool
    released: int = 0  # reserved attempts of a lost pack that never started


class OutageGrace:
    """Holds the reaper back right after the database comes back (see ReaperConfig)."""

    def __init__(self, seconds: float, clock=time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self.healthy_since: float | None = None

    def outage(self, _exc: BaseException | None = None) -> None:
        self.healthy_since = None

    def ready(self) -> bool:
        """True once the database has answered for `seconds` without an outage."""
        if self.healthy_since is None:
            self.healthy_since = self.clock()
        return self.clock() - self.healthy_since >= self.seconds


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
    released: set[int] = set()
    unstarted: set[int] = set()  # a lost pack's reserved attempts this pass releases
    for attempt in attempts:
        if attempt.id in unstarted:
            continue  # released, or its release waited on a lock: next pass, never charged
        if attempt.started_at is None:
            # Reserved with its pack: only the first of the pack's expired ones may have
            # been running when its worker was lost; the others never started.
            mates = _pack_mates_unstarted(attempt, now=now)
            unstarted |= {mate.id for mate in mates}
            released |= _release(mates, now=now, config=config)
            if attempt.id in unstarted:
                continue
        # Past its deadline the attempt timed out, whether or not its worker still lives.
        ended = (
            AttemptState.TIMED_OUT
            if attempt.deadline_at is not None and attempt.deadline_at <= now
            else AttemptState.LOST
        )
        run = attempt.run
        error = (
            f"lease expired at {attempt.lease_expires_at.isoformat()}"
            if ended == AttemptState.LOST
            else f"ran past its deadline {attempt.deadline_at.isoformat()}"
        )
        try:
            with transaction.atomic():
                lock_timeout_set_local(seconds=config.lock_timeout_seconds)
                failure = Failure(attempt=attempt, spec=run.job_version.spec,
                                  retry_base=run.retry_base, ended=ended, error=error)  # fmt: skip
                # Still expired when ended: a lease renewed since the read above wins.
                outcome = attempts_record_failure(
                    failures=[failure], now=now, by="reaper", only_if=expired
                )[attempt.id]
                failpoint("reaper.after_end")  # the attempt's and run's rows locked
                if outcome is None and attempt_abandon(attempt=attempt, now=now, error=error):
                    # Its run moved on without it (a bug or a hand edit): end it alone, or
                    # it would be read again on every pass.
                    log.error("attempt %s of run %s was orphaned; ended", attempt.number, run.id)
        except OperationalError:
            # The run row is locked, by a worker inside a `ctx.effect` block (frozen, or
            # slow): skip it this pass rather than stall every other expired attempt.
            log.warning("run %s is locked; its expired attempt is retried next pass", run.id)
            continue
        if outcome is None:
            continue
        log.warning(
            "attempt %s of run %s %s; run is now %s",
            attempt.number,
            run.id,
            "timed out" if ended == AttemptState.TIMED_OUT else "lost its lease",
            outcome,
        )
        if ended == AttemptState.TIMED_OUT:
            timed_out += 1
        else:
            lost += 1
    return ReaperResult(
        lost=lost,
        timed_out=timed_out,
        batch_full=len(attempts) >= config.batch_size,
        released=len(released),
    )


def _pack_mates_unstarted(attempt: Attempt, *, now: dt.datetime) -> list[Attempt]:
    """The reserved attempts of `attempt`'s pack (its claim) that never started, of those
    whose leases expired: a pack runs its reserved attempts one at a time in the order of
    their ids, so when its worker is lost only the first of them not yet recorded can have
    run (its handler running, or its success not yet written); every later one is released.
    The first is the first of all the pack's unrecorded reserved attempts, expired or not
    (pack-mates may have different heartbeat timeouts), and one charged or released earlier
    comes before them all: a pack's first is charged once, however many passes it takes."""
    mates = list(
        Attempt.objects.select_related("run__job_version")
        .filter(claim_id=attempt.claim_id, started_at__isnull=True, state=AttemptState.RUNNING)
        .order_by("id")
    )
    if not mates:
        return []
    earlier_ended = Attempt.objects.filter(
        claim_id=attempt.claim_id,
        started_at__isnull=True,
        state__in=[AttemptState.LOST, AttemptState.TIMED_OUT],
        id__lt=mates[0].id,
    ).exists()
    return [mate for mate in (mates if earlier_ended else mates[1:]) if mate.lease_expires_at < now]


def _release(attempts: list[Attempt], *, now: dt.datetime, config: ReaperConfig) -> set[int]:
    released = set()
    for attempt in attempts:
        try:
            with transaction.atomic():
                lock_timeout_set_local(seconds=config.lock_timeout_seconds)
                if attempt_release_unstarted(
                    attempt=attempt, by="reaper",
                    error="its pack's worker was lost before its turn",
                    # Still expired when released: a lease renewed since the read wins.
                    only_if=Q(lease_expires_at__lt=now),
                ):  # fmt: skip
                    released.add(attempt.id)
        except OperationalError:
            log.warning("run %s is locked; its reserved attempt is retried next pass",
                        attempt.run_id)  # fmt: skip
    if released:
        log.warning("released %d reserved attempts of a lost pack, not charged", len(released))
    return released
