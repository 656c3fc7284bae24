"""Partition leases: which scheduler replica dispatches which jobs (docs/architecture.md,
"Partitions").

Jobs fall into SCHEDULER_PARTITIONS partitions (jobs.partitions). A replica's scheduler
pass (materializer, promoter) claims only the due work of the partitions whose lease it
holds, checked inside the claim's own statement on the database's clock: a replica that
could not renew a lease dispatches nothing of it, whatever its threads believe.
`partitions_run_once` is one pass of a replica's lease keeping, every third of the lease
period; each statement commits on its own, so no lock is held across statements:

1. its membership row is renewed; one inserted (or expired until now) is a replica
   joining, and a NOTIFY on CHANNEL_PARTITIONS makes the others look at their share at once;
2. it counts the live replicas (membership not expired): its fair share is
   ceil(partitions / replicas);
3. it renews its leases (`UPDATE ... WHERE holder = me AND expires_at >= now`) and steps
   down from those it could not renew (they had expired: deleted, free for anyone);
4. above its share, it hands the surplus over to live replicas below theirs, changing the
   lease's holder in one conditional UPDATE: the partition is never unheld, so a joining
   replica takes its share without a pause in dispatch;
5. below its share, it acquires free partitions (INSERT ... ON CONFLICT DO NOTHING) and
   takes over expired ones (a conditional UPDATE), never beyond its share.

A replica whose membership expired has its scheduler session ended if it is still inside
a transaction (a replica frozen mid-pass), so the job rows it locked go with its
partitions. Its membership is kept until then, however late the next pass comes (a lone
replica's replacement starting minutes later).

The pass wakes again at the earliest expiry of another replica's lease or membership when
that comes before its next renewal, so a dead (SIGKILL) or paused (SIGSTOP) replica's
partitions are taken over as its leases expire: within one lease period of its last
renewal. On SIGTERM `partitions_release` deletes the replica's leases and membership and
notifies, so the others take them over within milliseconds.

Every statement is an operation of storage.partitions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import os
import secrets
import socket

from django.db import DatabaseError, connection, transaction

from jobs.clock import db_now
from jobs.notify import CHANNEL_PARTITIONS, CHANNEL_SCHEDULE, notify
from jobs.partitions import PartitionScope
from storage.partitions import (
    Session,
    leases_acquire_free,
    leases_by_holder,
    leases_hand_over,
    leases_release,
    leases_renew,
    leases_step_down,
    leases_take_over_expired,
    replica_delete,
    replica_membership_renew,
    replica_session_record,
    replica_sessions_terminate,
    replicas_prune_and_list,
    session_current,
)

from .config import config_require
from .wakeup import Listener

log = logging.getLogger("dispatch.partitions")
# Woken at another replica's expiry, a pass waits this much past it: at the very instant
# the lease is not yet expired (`expires_at < now` takes it over).
TAKEOVER_MARGIN_SECONDS = 0.05
# Rounds of acquisition in one pass: replicas acquiring together collide on a few
# partitions (ON CONFLICT DO NOTHING), and one more round takes others instead.
ACQUIRE_ROUNDS = 3


def replica_holder() -> str:
    """This process's name on its leases: host and pid (shown on /metrics), and a random
    suffix, so a restarted process with a recycled pid is another holder."""
    return f"{socket.gethostname()[:150]}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclasses.dataclass(frozen=True)
class PartitionsConfig:
    holder: str
    partitions: int = 64  # SCHEDULER_PARTITIONS: the same on every replica
    # SCHEDULER_PARTITION_LEASE_SECONDS (docs/architecture.md, "Partitions", says why 10).
    lease_seconds: float = 10.0

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("partitions",), positive=("lease_seconds",))
        if not self.holder:
            raise ValueError("PartitionsConfig.holder must not be empty")

    @property
    def poll_interval(self) -> float:
        """Renewal every third of the period: two renewals may fail (a slow statement, a
        short outage) before a lease expires."""
        return self.lease_seconds / 3

    @property
    def scope(self) -> PartitionScope:
        return PartitionScope(holder=self.holder, partitions=self.partitions)


@dataclasses.dataclass(frozen=True)
class PartitionsResult:
    held: int = 0  # partitions this replica holds after the pass
    replicas: int = 1  # live replicas it counted, itself included
    share: int = 0  # ceil(partitions / replicas): the most it takes
    renewed: int = 0
    acquired: int = 0  # free ones acquired and expired ones taken over
    handed_over: int = 0  # surplus given to replicas below their share
    stepped_down: int = 0  # its leases found expired (or beyond the count): not held
    joined: bool = False  # its membership was new (or had expired)
    sessions_ended: int = 0  # scheduler sessions of replicas gone (expired), ended
    # Until the next expiry of another replica's lease or membership (None: none live).
    next_expiry_seconds: float | None = None


def partitions_run_once(
    *, now: dt.datetime, config: PartitionsConfig, session: Session | None = None
) -> PartitionsResult:
    """One pass; `session`: the scheduler loop's database session (pid, backend_start),
    recorded with this replica's membership."""
    until = now + dt.timedelta(seconds=config.lease_seconds)
    me, count = config.holder, config.partitions
    joined = replica_membership_renew(holder=me, now=now, until=until, session=session)
    members = replicas_prune_and_list(stale_before=now - dt.timedelta(seconds=config.lease_seconds))
    replicas = {holder: at for holder, at in members.items() if at >= now} | {me: until}
    gone = [holder for holder, at in members.items() if at < now]
    share = math.ceil(count / len(replicas))
    held = leases_renew(holder=me, now=now, until=until, partitions=count)
    renewed = len(held)
    # After the renewal: a refusal to end a session never costs this replica its leases.
    sessions_ended = _sessions_end(holders=gone, now=now) if gone else 0
    stepped_down = leases_step_down(holder=me, now=now, partitions=count)
    leases = leases_by_holder(now=now, partitions=count)
    handed_over = 0
    if len(held) > share:
        handed = _hand_over(
            config=config, held=held, share=share, now=now, until=until,
            recipients=_recipients(config, replicas, leases, share, now),
        )  # fmt: skip
        held -= handed
        handed_over = len(handed)
    acquired = set()
    for _ in range(ACQUIRE_ROUNDS):
        if len(held) + len(acquired) >= share:
            break
        gained = _acquire(config=config, want=share - len(held) - len(acquired),
                          now=now, until=until)  # fmt: skip
        if not gained:
            break
        acquired |= gained
    if joined:
        notify(CHANNEL_PARTITIONS)  # the others hand over to it now, not at their renewal
    if acquired or handed_over:
        notify(CHANNEL_SCHEDULE)  # the schedulers look again at what is theirs and due
    if acquired or handed_over or stepped_down:
        log.info(
            "partitions: holding %d (share %d of %d among %d replicas): %d acquired, "
            "%d handed over, %d stepped down from",
            len(held) + len(acquired), share, count, len(replicas), len(acquired),
            handed_over, stepped_down,
        )  # fmt: skip
    foreign = [at for holder, at in replicas.items() if holder != me]
    foreign += [lease.earliest_expiry for holder, lease in leases.items() if holder != me]
    return PartitionsResult(
        held=len(held) + len(acquired),
        replicas=len(replicas),
        share=share,
        renewed=renewed,
        acquired=len(acquired),
        handed_over=handed_over,
        stepped_down=stepped_down,
        joined=joined,
        sessions_ended=sessions_ended,
        next_expiry_seconds=(min(foreign) - now).total_seconds() if foreign else None,
    )


def _sessions_end(*, holders: list[str], now: dt.datetime) -> int:
    """End the scheduler sessions of replicas whose membership expired (their leases
    expire with it, and move), if still inside a transaction: a replica frozen (SIGSTOP)
    in the middle of a pass keeps the job rows it claimed locked, and every other
    replica's SKIP LOCKED passes them by until its session ends. A replica alive enough to
    renew its membership keeps its session; only the very session recorded is ended (pid
    and backend_start). Any replica may do it (a session already ended no longer
    matches), at any pass after the expiry: the membership row stays while its session is
    inside a transaction (storage.partitions.replicas_prune_and_list). Needs the same
    database role for every scheduler (or pg_signal_backend)."""
    try:
        with transaction.atomic():
            ended = replica_sessions_terminate(holders=holders, now=now)
    except DatabaseError as exc:
        # Another database role without pg_signal_backend: the frozen replica's locked jobs
        # then wait until its session ends by itself (docs/architecture.md, "Partitions").
        log.warning("could not end the sessions of replicas whose membership expired: %s", exc)
        return 0
    if ended:
        log.warning("ended %d scheduler sessions of replicas whose membership expired", ended)
    return ended


def _recipients(
    config: PartitionsConfig, replicas: dict, leases: dict, share: int, now: dt.datetime
) -> list[tuple[str, int]]:
    """(replica, how many it lacks) of the live replicas below their share, fewest leases
    first. Only those that renewed their membership within half a period: one paused
    since would sit on what it is given until its leases expire."""
    fresh = now + dt.timedelta(seconds=config.lease_seconds / 2)
    lacking = [
        (holder, share - (leases[holder].count if holder in leases else 0))
        for holder, expires_at in replicas.items()
        if holder != config.holder and expires_at > fresh
    ]
    return sorted(
        [(holder, lack) for holder, lack in lacking if lack > 0], key=lambda item: -item[1]
    )


def _hand_over(
    *,
    config: PartitionsConfig,
    held: set[int],
    share: int,
    recipients: list[tuple[str, int]],
    now: dt.datetime,
    until: dt.datetime,
) -> set[int]:
    """Give the partitions held beyond `share` to the replicas lacking some; returns those
    given. The holder changes in one conditional UPDATE (still ours, not expired): the
    recipient's claims include the partition from that commit, ours no longer do. A
    surplus nobody lacks stays here (held, dispatched) rather than unheld."""
    surplus = sorted(held, reverse=True)[: len(held) - share]
    given: set[int] = set()
    for holder, lack in recipients:
        batch, surplus = surplus[:lack], surplus[lack:]
        if not batch:
            break
        given |= leases_hand_over(
            partitions=batch, from_holder=config.holder, to_holder=holder, now=now, until=until
        )
    return given


def _acquire(
    *, config: PartitionsConfig, want: int, now: dt.datetime, until: dt.datetime
) -> set[int]:
    """Up to `want` partitions: free ones first (no lease row), then expired ones taken
    over, each chosen at random (storage.partitions)."""
    lease = {"holder": config.holder, "now": now, "until": until, "partitions": config.partitions}
    gained = leases_acquire_free(want=want, **lease)
    if len(gained) < want:
        gained |= leases_take_over_expired(want=want - len(gained), **lease)
    return gained


def partitions_release(*, holder: str) -> int:
    """Give up every lease and the membership of `holder` (a replica stopping on SIGTERM),
    waking the others to take them over at once; returns the leases released."""
    released = leases_release(holder=holder)
    replica_delete(holder=holder)
    notify(CHANNEL_PARTITIONS)
    return released


class PartitionKeeper:
    """How `manage.py scheduler` keeps its leases: a pass every third of the period, sooner
    when another replica's lease or membership expires before that (to take it over as it
    expires) or when a NOTIFY on CHANNEL_PARTITIONS says a replica joined or left; the
    leases released when the loop stops."""

    def __init__(self, config: PartitionsConfig, listener: Listener) -> None:
        self.config = config
        self.listener = listener
        # The scheduler loop's current database session.
        self.session: Session | None = None

    def scheduler_session_opened(self) -> None:
        """Called on the scheduler loop's thread as it opens a database session (every
        CONN_MAX_AGE): recorded with the membership at once, before the session's first
        transaction (see _sessions_end), and by the passes when they insert it again."""
        session = replica_session_record(holder=self.config.holder)
        # No membership yet: the next pass inserts it with this session.
        self.session = session if session is not None else session_current()

    def run_once(self, *, now: dt.datetime, config: PartitionsConfig) -> PartitionsResult:
        return partitions_run_once(now=now, config=config, session=self.session)

    def first_pass(self) -> PartitionsResult | None:
        """One pass before the scheduler's first: a replica starting alone dispatches every
        partition from its first pass. An outage is left to the loop's retries."""
        try:
            return self.run_once(now=db_now(), config=self.config)
        except DatabaseError as exc:
            log.warning("first partition lease pass failed, the loop retries: %r", exc)
            return None
        finally:
            connection.close()  # this thread's: the loop's thread has its own

    def sleep_seconds(self, result: PartitionsResult) -> float:
        seconds = self.config.poll_interval
        if result.next_expiry_seconds is not None:
            seconds = min(seconds, result.next_expiry_seconds + TAKEOVER_MARGIN_SECONDS)
        return max(0.0, seconds)

    def wait(self, seconds: float) -> None:
        self.listener.wait(seconds)

    def close(self) -> None:
        """Release the leases (the loop stopped), then the listener."""
        try:
            released = partitions_release(holder=self.config.holder)
            log.info("released %d partition leases", released)
        except DatabaseError as exc:  # they expire within one lease period
            log.warning("partition leases not released: %r", exc)
        finally:
            self.listener.close()
