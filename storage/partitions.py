"""Partition leases and scheduler replicas' memberships (dispatch.partitions keeps them).

Tables: `jobs_partition_lease` (partition, holder, expires_at, acquired_at) and
`jobs_scheduler_replica` (holder, expires_at, joined_at, session_pid, session_started_at).
Every operation is one statement that commits on its own unless the caller opened a
transaction: the lease keeper holds no lock across statements. Instants are the caller's
`now` (the database's clock read by the loop), never the statement's.
"""

from __future__ import annotations

import datetime as dt
from typing import NamedTuple

from .sql import execute, fetch_all, fetch_one, fetch_value

LEASE = "jobs_partition_lease"
REPLICA = "jobs_scheduler_replica"


def job_partition_sql(job_id: str, partitions: str = "%s") -> str:
    """SQL: the partition of the job id column `job_id` (jobs.partitions.job_partition in
    Python): its last 8 hex digits as an unsigned 32-bit number, modulo `partitions` (a
    placeholder, positional by default). Nothing is stored, so the partition count may
    change with a restart of every replica and no migration."""
    return f"(('x' || right(({job_id})::text, 8))::bit(32)::bigint %% {partitions})"


def in_held_partitions_sql(partition: str, held: str) -> str:
    """SQL: a condition that `partition` (job_partition_sql) is among `held` (a subquery
    of the partitions a holder's leases cover): `partition = ANY(ARRAY(held))`, so the
    leases are read once per statement (an InitPlan) and a due-work index is still walked
    in order under a LIMIT (an IN (subquery) became a join, then a sort of every due row
    of the partitions held: the whole backlog sorted at every pass after an outage). The
    uncorrelated EXISTS is a one-time filter: a holder holding nothing walks no index."""
    return f"({partition} = ANY(ARRAY{held}) AND EXISTS{held})"


def held_partitions_sql(holder: str, partitions: str) -> str:
    """SQL: a subquery of the partitions whose lease `holder` (a placeholder) holds at the
    statement's start (the database's clock), of the first `partitions` (a placeholder)."""
    return (
        f"(SELECT partition FROM {LEASE} WHERE expires_at > statement_timestamp()"
        f" AND holder = {holder} AND partition < {partitions})"
    )


class Session(NamedTuple):
    """A database session: its backend's pid and start (pg_stat_activity)."""

    pid: int
    started_at: dt.datetime


class HolderLeases(NamedTuple):
    """A holder's live leases: how many, and the earliest expiry among them."""

    count: int
    earliest_expiry: dt.datetime


def replica_membership_renew(
    *, holder: str, now: dt.datetime, until: dt.datetime, session: Session | None
) -> bool:
    """Insert `holder`'s membership, or renew it until `until`; True when it joins (no row
    before, or one expired at `now`: the others counted it gone). A session already
    recorded stays (the scheduler thread records each new one itself,
    `replica_session_record`). INSERT ... ON CONFLICT: the membership's row lock until the
    statement commits."""
    pid, started_at = session or (None, None)
    return fetch_value(
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
        {"me": holder, "until": until, "now": now, "pid": pid, "started_at": started_at},
    )  # fmt: skip


def replicas_prune_and_list(*, stale_before: dt.datetime) -> dict[str, dt.datetime]:
    """Delete the memberships expired before `stale_before` (gone for a whole lease period)
    whose recorded session is not inside a transaction (ended, or idle: it locks nothing),
    and return every membership as holder -> expiry, the deleted ones included (one
    snapshot). One whose session is still inside a transaction (a replica frozen mid-pass)
    stays, however long, until a pass ends that session (`replica_sessions_terminate`): a
    replacement that comes late still finds it. Row locks on the rows deleted."""
    rows = fetch_all(
        f"""
        WITH gone AS (
            DELETE FROM {REPLICA} AS replica
             WHERE expires_at < %(stale)s
               AND NOT EXISTS (SELECT 1 FROM pg_stat_activity AS activity
                                WHERE activity.pid = replica.session_pid
                                  AND activity.backend_start = replica.session_started_at
                                  AND activity.xact_start IS NOT NULL)
        )
        SELECT holder, expires_at FROM {REPLICA}
        """,
        {"stale": stale_before},
    )  # fmt: skip
    return dict(rows)


def leases_renew(*, holder: str, now: dt.datetime, until: dt.datetime, partitions: int) -> set[int]:
    """Extend until `until` the leases `holder` holds that have not expired at `now` (of the
    first `partitions` partitions); the partitions renewed. Row locks on those leases."""
    rows = fetch_all(
        f"""UPDATE {LEASE} SET expires_at = %(until)s
             WHERE holder = %(me)s AND expires_at >= %(now)s AND partition < %(count)s
            RETURNING partition""",
        {"until": until, "me": holder, "now": now, "count": partitions},
    )
    return {row[0] for row in rows}


def replica_sessions_terminate(*, holders: list[str], now: dt.datetime) -> int:
    """End (pg_terminate_backend) the recorded database sessions of these replicas whose
    membership expired before `now`, of those still inside a transaction; how many were
    ended. Only the very session recorded (pid and backend_start) is matched. Takes no row
    lock; raises DatabaseError without the right to signal the other role's backends (run
    it in a savepoint)."""
    return fetch_value(
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


def leases_step_down(*, holder: str, now: dt.datetime, partitions: int) -> int:
    """Delete `holder`'s leases that expired before `now` or lie beyond the partition
    count (free for anyone from the commit); how many. Row locks on those leases."""
    return execute(
        f"""DELETE FROM {LEASE}
             WHERE holder = %(me)s AND (expires_at < %(now)s OR partition >= %(count)s)""",
        {"me": holder, "now": now, "count": partitions},
    )


def leases_by_holder(*, now: dt.datetime, partitions: int) -> dict[str, HolderLeases]:
    """Every holder's leases live at `now`, of the first `partitions` partitions. No lock."""
    rows = fetch_all(
        f"""SELECT holder, count(*), min(expires_at) FROM {LEASE}
             WHERE expires_at >= %(now)s AND partition < %(count)s GROUP BY holder""",
        {"now": now, "count": partitions},
    )
    return {holder: HolderLeases(count, earliest) for holder, count, earliest in rows}


def leases_hand_over(
    *,
    partitions: list[int],
    from_holder: str,
    to_holder: str,
    now: dt.datetime,
    until: dt.datetime,
) -> set[int]:
    """Give `to_holder` these partitions' leases, of those `from_holder` still holds
    unexpired at `now`: one conditional UPDATE, so a partition is never unheld. The
    partitions given; row locks on their leases."""
    rows = fetch_all(
        f"""UPDATE {LEASE} SET holder = %(to)s, expires_at = %(until)s, acquired_at = %(now)s
             WHERE partition = ANY(%(batch)s) AND holder = %(me)s AND expires_at >= %(now)s
            RETURNING partition""",
        {"to": to_holder, "until": until, "now": now, "batch": partitions, "me": from_holder},
    )
    return {row[0] for row in rows}


def leases_acquire_free(
    *, holder: str, want: int, now: dt.datetime, until: dt.datetime, partitions: int
) -> set[int]:
    """Up to `want` partitions that have no lease row, chosen at random (replicas acquiring
    together mostly take different ones) and inserted in partition order (two inserts that
    meet wait on each other in one direction only); one taken meanwhile is passed over (ON
    CONFLICT DO NOTHING). The partitions acquired; their new rows locked."""
    rows = fetch_all(
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
        {"me": holder, "until": until, "now": now, "count": partitions, "want": want},
    )  # fmt: skip
    return {row[0] for row in rows}


def leases_take_over_expired(
    *, holder: str, want: int, now: dt.datetime, until: dt.datetime, partitions: int
) -> set[int]:
    """Up to `want` leases expired at `now`, chosen at random and claimed FOR UPDATE SKIP
    LOCKED (another replica taking one over is passed by), given to `holder` if still
    expired. The partitions taken over; row locks on their leases."""
    rows = fetch_all(
        f"""
        UPDATE {LEASE} SET holder = %(me)s, expires_at = %(until)s, acquired_at = %(now)s
         WHERE partition IN (SELECT partition FROM {LEASE}
                              WHERE expires_at < %(now)s AND partition < %(count)s
                              ORDER BY random() LIMIT %(want)s
                              FOR UPDATE SKIP LOCKED)
           AND expires_at < %(now)s
        RETURNING partition
        """,
        {"me": holder, "until": until, "now": now, "count": partitions, "want": want},
    )  # fmt: skip
    return {row[0] for row in rows}


def leases_release(*, holder: str) -> int:
    """Delete every lease of `holder`; how many. Row locks on them."""
    return execute(f"DELETE FROM {LEASE} WHERE holder = %s", [holder])


def replica_delete(*, holder: str) -> int:
    """Delete `holder`'s membership; 1, or 0 when it had none. Its row lock."""
    return execute(f"DELETE FROM {REPLICA} WHERE holder = %s", [holder])


def replica_session_record(*, holder: str) -> Session | None:
    """Record the calling session (pid, backend_start) on `holder`'s membership; the
    session, or None when `holder` has no membership yet. The membership's row lock."""
    row = fetch_one(
        f"""
        UPDATE {REPLICA}
           SET session_pid = activity.pid, session_started_at = activity.backend_start
          FROM pg_stat_activity AS activity
         WHERE activity.pid = pg_backend_pid() AND holder = %s
        RETURNING activity.pid, activity.backend_start
        """,
        [holder],
    )  # fmt: skip
    return None if row is None else Session(*row)


def session_current() -> Session:
    """The calling database session. No lock."""
    row = fetch_one("SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()")
    return Session(*row)
