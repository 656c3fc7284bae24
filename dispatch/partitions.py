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
partitions.

The pass wakes again at the earliest expiry of another replica's lease or membership when
that comes before its next renewal, so a dead (SIGKILL) or paused (SIGSTOP) replica's
partitions are taken over as its leases expire: within one lease period of its last
renewal. On SIGTERM `partitions_release` deletes the replica's leases and membership and
notifies, so the others take them over within milliseconds.

PostgreSQL only: on SQLite (the embedded defaults, one scheduler) the scheduler dispatches
every partition and runs no lease keeping.
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
from jobs.models import PartitionLease, SchedulerReplica
from jobs.notify import CHANNEL_PARTITIONS, CHANNEL_SCHEDULE, notify
from jobs.partitions import PartitionScope

from .config import config_require
from .wakeup import Listener

log = logging.getLogger("dispatch.partitions")
LEASE = PartitionLease._meta.db_table
REPLICA = SchedulerReplica._meta.db_table
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
    *, now: dt.datetime, config: PartitionsConfig, session: tuple | None = None
) -> PartitionsResult:
    """One pass; `session`: (pid, backend_start) of this replica's scheduler loop's
    database session, recorded with its membership."""
    until = now + dt.timedelta(seconds=config.lease_seconds)
    me, count = config.holder, config.partitions
    with connection.cursor() as cursor:
        joined = _membership_renew(cursor, me=me, now=now, until=until, session=session)
        cursor.execute(
            f"""
            WITH gone AS (DELETE FROM {REPLICA} WHERE expires_at < %(stale)s)
            SELECT holder, expires_at FROM {REPLICA}
            """,
            {"stale": now - dt.timedelta(seconds=config.lease_seconds)},
        )  # fmt: skip
        members = dict(cursor.fetchall())
        replicas = {holder: at for holder, at in members.items() if at >= now} | {me: until}
        gone = [holder for holder, at in members.items() if at < now]
        share = math.ceil(count / len(replicas))
        cursor.execute(
            f"""UPDATE {LEASE} SET expires_at = %(until)s
                 WHERE holder = %(me)s AND expires_at >= %(now)s AND partition < %(count)s
                RETURNING partition""",
            {"until": until, "me": me, "now": now, "count": count},
        )
        held = {row[0] for row in cursor.fetchall()}
        renewed = len(held)
        # After the renewal: a refusal to end a session never costs this replica its leases.
        sessions_ended = _sessions_end(cursor, holders=gone, now=now) if gone else 0
        cursor.execute(
            f"""DELETE FROM {LEASE}
                 WHERE holder = %(me)s AND (expires_at < %(now)s OR partition >= %(count)s)""",
            {"me": me, "now": now, "count": count},
        )
        stepped_down = cursor.rowcount
        cursor.execute(
            f"""SELECT holder, count(*), min(expires_at) FROM {LEASE}
                 WHERE expires_at >= %(now)s AND partition < %(count)s GROUP BY holder""",
            {"now": now, "count": count},
        )
        leases = {holder: (n, earliest) for holder, n, earliest in cursor.fetchall()}
        handed_over = 0
        if len(held) > share:
            handed = _hand_over(
                cursor, config=config, held=held, share=share, now=now, until=until,
                recipients=_recipients(config, replicas, leases, share, now),
            )  # fmt: skip
            held -= handed
            handed_over = len(handed)
        acquired = set()
        for _ in range(ACQUIRE_ROUNDS):
            if len(held) + len(acquired) >= share:
                break
            gained = _acquire(cursor, config=config, want=share - len(held) - len(acquired),
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
    foreign += [earliest for holder, (_, earliest) in leases.items() if holder != me]
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


def _membership_renew(
    cursor, *, me: str, now: dt.datetime, until: dt.datetime, session: tuple | None
) -> bool:
    """Insert or renew this replica's membership; True when it joins (no row before, or
    one that had expired: the others counted it gone)."""
    pid, started_at = session or (None, None)
    cursor.execute(
        f"""
        WITH before AS (SELECT expires_at FROM {REPLICA} WHERE holder = %(me)s)
        INSERT INTO {REPLICA} (holder, expires_at, joined_at, session_pid, session_started_at)
        VALUES (%(me)s, %(until)s, %(now)s, %(pid)s, %(started_at)s)
        ON CONFLICT (holder) DO UPDATE
           SET expires_at = EXCLUDED.expires_at,
               -- the scheduler thread records each new session itself, at once
               session_pid = coalesce({REPLICA}.session_pid, EXCLUDED.session_pid),
               session_started_at = coalesce({REPLICA}.session_started_at,
                                             EXCLUDED.session_started_at)
        RETURNING (SELECT coalesce(bool_and(expires_at < %(now)s), true) FROM before)
        """,
        {"me": me, "until": until, "now": now, "pid": pid, "started_at": started_at},
    )  # fmt: skip
    return cursor.fetchone()[0]


def _sessions_end(cursor, *, holders: list[str], now: dt.datetime) -> int:
    """End the scheduler sessions of replicas whose membership expired (their leases
    expire with it, and move), if still inside a transaction: a replica frozen (SIGSTOP)
    in the middle of a pass keeps the job rows it claimed locked, and every other
    replica's SKIP LOCKED passes them by until its session ends. A replica alive enough to
    renew its membership keeps its session; only the very session recorded is ended (pid
    and backend_start). Any replica may do it (a session already ended no longer
    matches), in the passes of the lease period before the membership row is deleted.
    Needs the same database role for every scheduler (or pg_signal_backend)."""
    try:
        with transaction.atomic():
            ended = _sessions_terminate(cursor, holders=holders, now=now)
    except DatabaseError as exc:
        # Another database role without pg_signal_backend: the frozen replica's locked jobs
        # then wait until its session ends by itself (docs/architecture.md, "Partitions").
        log.warning("could not end the sessions of replicas whose membership expired: %s", exc)
        return 0
    if ended:
        log.warning("ended %d scheduler sessions of replicas whose membership expired", ended)
    return ended


def _sessions_terminate(cursor, *, holders: list[str], now: dt.datetime) -> int:
    cursor.execute(
        f"""
        SELECT count(*) FILTER (WHERE pg_terminate_backend(activity.pid))
          FROM {REPLICA} AS replica
          JOIN pg_stat_activity AS activity
            ON activity.pid = replica.session_pid
           AND activity.backend_start = replica.session_started_at
         WHERE replica.holder = ANY(%(holders)s) AND replica.expires_at < %(now)s
           AND activity.xact_start IS NOT NULL
        """,
        {"holders": holders, "now": now},
    )  # fmt: skip
    return cursor.fetchone()[0]


def _recipients(
    config: PartitionsConfig, replicas: dict, leases: dict, share: int, now: dt.datetime
) -> list[tuple[str, int]]:
    """(replica, how many it lacks) of the live replicas below their share, fewest leases
    first. Only those that renewed their membership within half a period: one paused
    since would sit on what it is given until its leases expire."""
    fresh = now + dt.timedelta(seconds=config.lease_seconds / 2)
    lacking = [
        (holder, share - leases.get(holder, (0, None))[0])
        for holder, expires_at in replicas.items()
        if holder != config.holder and expires_at > fresh
    ]
    return sorted(
        [(holder, lack) for holder, lack in lacking if lack > 0], key=lambda item: -item[1]
    )


def _hand_over(
    cursor,
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
        cursor.execute(
            f"""UPDATE {LEASE} SET holder = %(to)s, expires_at = %(until)s, acquired_at = %(now)s
                 WHERE partition = ANY(%(batch)s) AND holder = %(me)s AND expires_at >= %(now)s
                RETURNING partition""",
            {"to": holder, "until": until, "now": now, "batch": batch, "me": config.holder},
        )
        given |= {row[0] for row in cursor.fetchall()}
    return given


def _acquire(
    cursor, *, config: PartitionsConfig, want: int, now: dt.datetime, until: dt.datetime
) -> set[int]:
    """Up to `want` partitions: free ones first (no lease row), then expired ones taken
    over. Chosen at random, so replicas acquiring together mostly take different ones;
    inserted in partition order, so two inserts that meet wait on each other in one
    direction only (in random order they deadlocked)."""
    values = {"me": config.holder, "until": until, "now": now, "count": config.partitions}
    cursor.execute(
        f"""
        INSERT INTO {LEASE} (partition, holder, expires_at, acquired_at)
        SELECT free, %(me)s, %(until)s, %(now)s
          FROM (SELECT free FROM generate_series(0, %(count)s - 1) AS free
                 WHERE NOT EXISTS (SELECT 1 FROM {LEASE} WHERE partition = free)
                 ORDER BY random() LIMIT %(want)s) AS chosen
         ORDER BY free
        ON CONFLICT (partition) DO NOTHING
        RETURNING partition
        """,
        {**values, "want": want},
    )  # fmt: skip
    gained = {row[0] for row in cursor.fetchall()}
    if len(gained) < want:
        cursor.execute(
            f"""
            UPDATE {LEASE} SET holder = %(me)s, expires_at = %(until)s, acquired_at = %(now)s
             WHERE partition IN (SELECT partition FROM {LEASE}
                                  WHERE expires_at < %(now)s AND partition < %(count)s
                                  ORDER BY random() LIMIT %(want)s
                                  FOR UPDATE SKIP LOCKED)
               AND expires_at < %(now)s
            RETURNING partition
            """,
            {**values, "want": want - len(gained)},
        )  # fmt: skip
        gained |= {row[0] for row in cursor.fetchall()}
    return gained


def partitions_release(*, holder: str) -> int:
    """Give up every lease and the membership of `holder` (a replica stopping on SIGTERM),
    waking the others to take them over at once; returns the leases released."""
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {LEASE} WHERE holder = %s", [holder])
        released = cursor.rowcount
        cursor.execute(f"DELETE FROM {REPLICA} WHERE holder = %s", [holder])
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
        # (pid, backend_start) of the scheduler loop's current database session.
        self.session: tuple | None = None

    def scheduler_session_opened(self, connection) -> None:
        """Called on the scheduler loop's thread as it opens a database session (every
        CONN_MAX_AGE): recorded with the membership at once, before the session's first
        transaction (see _sessions_end), and by the passes when they insert it again."""
        with connection.cursor() as cursor:
            cursor.execute(
                f"""
                UPDATE {REPLICA}
                   SET session_pid = activity.pid, session_started_at = activity.backend_start
                  FROM pg_stat_activity AS activity
                 WHERE activity.pid = pg_backend_pid() AND holder = %s
                RETURNING activity.pid, activity.backend_start
                """,
                [self.config.holder],
            )  # fmt: skip
            row = cursor.fetchone()
            if row is None:  # no membership yet: the next pass inserts it with this session
                cursor.execute(
                    "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
                )
                row = cursor.fetchone()
            self.session = tuple(row)

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
