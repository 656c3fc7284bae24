"""Queue controls: the statements behind pausing a queue, capping its running runs and
limiting its publications a second across the fleet (dispatch.queues holds the policy).

A pause is in force while `paused` is set and `paused_until` is unset or still ahead on
the database's clock: an `until` ends it with no process acting. Every statement here
reads the pause that way (PAUSED_IN_FORCE).
"""

from __future__ import annotations

import json
import uuid
from typing import NamedTuple

from .outbox import OUTBOX_TABLE, PENDING
from .sql import execute, fetch_all, fetch_one, fetch_value

QUEUE_TABLE = "jobs_queuecontrol"
RUN_TABLE = "jobs_run"
VERSION_TABLE = "jobs_jobversion"

# Whether the pause of the row aliased `q` is in force now (the database's clock).
PAUSED_IN_FORCE = "(q.paused AND (q.paused_until IS NULL OR q.paused_until > clock_timestamp()))"


class QueueHold(NamedTuple):
    """What a relay needs to know of a controlled queue at one step."""

    name: str
    paused: bool
    max_running: int | None
    burst: float | None  # the rate's burst; None without a rate


def queues_pause_expired_end() -> list[str]:
    """Clear every pause whose `until` has passed on the database's clock (paused off,
    `until` unset), in one conditional UPDATE in the caller's transaction; the names of
    the queues it ended. Its row locks last the transaction: a second caller waits, then
    finds those pauses cleared and ends none of them, so each pause is ended once."""
    return [
        row[0]
        for row in fetch_all(
            f"""
            UPDATE {QUEUE_TABLE} AS q SET paused = false, paused_until = NULL
             WHERE q.paused AND q.paused_until IS NOT NULL AND q.paused_until <= clock_timestamp()
            RETURNING q.name
            """
        )
    ]


def queues_held() -> dict[str, QueueHold]:
    """Every queue with a control in force (paused now, a cap or a rate): one statement,
    no lock."""
    rows = fetch_all(
        f"""
        SELECT q.name, {PAUSED_IN_FORCE}, q.max_running,
               CASE WHEN q.rate_per_second IS NOT NULL THEN q.burst END
          FROM {QUEUE_TABLE} AS q
         WHERE {PAUSED_IN_FORCE} OR q.max_running IS NOT NULL OR q.rate_per_second IS NOT NULL
        """
    )
    return {row[0]: QueueHold(*row) for row in rows}


def queue_running_count(*, queue: str, running: bool = True, in_broker: bool = False) -> int:
    """The queue's runs (its lanes' too) that are `running` (with `running`), and those
    `queued` with no pending outbox row (with `in_broker`: published, in the broker or a
    worker's prefetch). No lock; the caller's snapshot."""
    states = (["running"] if running else []) + (["queued"] if in_broker else [])
    return fetch_value(
        f"""
        SELECT count(*) FROM {RUN_TABLE} AS r JOIN {VERSION_TABLE} AS v ON v.id = r.job_version_id
         WHERE r.state = ANY(%(states)s) AND v.spec->>'queue' = %(queue)s
           AND (r.state = 'running' OR NOT EXISTS (
                SELECT 1 FROM {OUTBOX_TABLE} AS o WHERE o.run_id = r.id AND o.state = %(pending)s))
        """,
        {"states": states, "queue": queue, "pending": PENDING},
    )


# The advisory lock space of the relays' room in a capped or rate-limited queue
# (pg_advisory_xact_lock(space, hashtext(queue))).
ROOM_LOCK_SPACE = 0x0C4B


def queue_room_lock_counts(*, queue: str) -> tuple[int, int]:
    """For a relay about to claim rows of a capped or rate-limited queue: take the queue's
    room lock (an advisory lock, held until the caller's transaction ends: the relays'
    claims of the queue go one at a time), then count, in a statement of its own (a snapshot
    taken after the lock, which sees every claim committed before), the queue's runs (its
    lanes' too) `running`, and those `queued` and published: in the broker, in a worker's
    prefetch, or being published (their pending row under a relay's live claim). A queued
    run with a pending row no live claim holds waits in PostgreSQL. (running, published)."""
    execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [ROOM_LOCK_SPACE, queue])
    row = fetch_one(
        f"""
        SELECT count(*) FILTER (WHERE r.state = 'running'),
               count(*) FILTER (WHERE r.state = 'queued')
          FROM {RUN_TABLE} AS r JOIN {VERSION_TABLE} AS v ON v.id = r.job_version_id
         WHERE r.state IN ('running', 'queued') AND v.spec->>'queue' = %(queue)s
           AND (r.state = 'running' OR NOT EXISTS (
                SELECT 1 FROM {OUTBOX_TABLE} AS o WHERE o.run_id = r.id AND o.state = %(pending)s
                   AND (o.claimed_until IS NULL OR o.claimed_until < now())))
        """,
        {"queue": queue, "pending": PENDING},
    )
    return int(row[0]), int(row[1])


class RunGate(NamedTuple):
    """The control of a delivered run's queue at its claim."""

    queue: str
    paused: bool
    max_running: int | None
    rate_limited: bool


def run_gate_lock(*, run_id: uuid.UUID | str) -> RunGate | None:
    """The control of the run's queue, None when it has none; its row stays locked until
    the caller's transaction ends: FOR SHARE (a pause, which updates the row, waits for the
    claims in flight and every later claim reads it), FOR UPDATE when the queue has a cap or a
    rate (claims of such a queue are serialized, so the count the caller makes next, a new
    statement with a new snapshot, sees every claim committed before). Two statements in
    the caller's transaction."""
    row = fetch_one(
        f"""
        SELECT q.name, q.max_running IS NOT NULL OR q.rate_per_second IS NOT NULL
          FROM {RUN_TABLE} AS r JOIN {VERSION_TABLE} AS v ON v.id = r.job_version_id
          JOIN {QUEUE_TABLE} AS q ON q.name = v.spec->>'queue'
         WHERE r.id = %(run_id)s
        """,
        {"run_id": run_id},
    )
    if row is None:
        return None
    mode = "UPDATE" if row[1] else "SHARE"
    row = fetch_one(
        f"SELECT q.name, {PAUSED_IN_FORCE}, q.max_running, q.rate_per_second IS NOT NULL"
        f" FROM {QUEUE_TABLE} AS q"
        f" WHERE q.name = %s FOR {mode}",
        [row[0]],
    )
    return RunGate(*row) if row else None


def runs_of_held_queues(*, run_ids: list[str]) -> list[str]:
    """Those of the runs whose queue is paused now, capped or rate-limited (their claims go
    one by one,
    through the gate). No lock."""
    rows = fetch_all(
        f"""
        SELECT r.id::text FROM {RUN_TABLE} AS r JOIN {VERSION_TABLE} AS v ON v.id = r.job_version_id
          JOIN {QUEUE_TABLE} AS q ON q.name = v.spec->>'queue'
         WHERE r.id = ANY(%(ids)s::uuid[])
           AND ({PAUSED_IN_FORCE} OR q.max_running IS NOT NULL OR q.rate_per_second IS NOT NULL)
        """,
        {"ids": run_ids},
    )
    return [run_id for (run_id,) in rows]


def run_has_pending_message(*, run_id: uuid.UUID | str) -> bool:
    """Whether the run has a pending outbox row that will be published: one under a
    relay's live claim is being published now and goes once confirmed (its message may be
    the very one being handed back), so it does not count. No lock."""
    return bool(
        fetch_value(
            f"SELECT EXISTS (SELECT 1 FROM {OUTBOX_TABLE} WHERE run_id = %s AND state = %s"
            " AND (claimed_until IS NULL OR claimed_until < now()))",
            [run_id, PENDING],
        )
    )


def queue_token_take(*, queue: str) -> float:
    """Take one token from the queue's bucket, refilled first at its rate since it was last
    taken from (on the database's clock), never above its burst. 0.0: taken; otherwise the
    seconds until a token is there (nothing taken). One conditional UPDATE that locks the
    queue row until the caller's transaction ends (the claim's: a start and its token
    commit together), so every worker draws from one bucket."""
    row = fetch_one(
        f"""
        WITH bucket AS (
            SELECT q.name, q.rate_per_second AS rate,
                   LEAST(q.burst, q.tokens + q.rate_per_second * GREATEST(0,
                       extract(epoch FROM clock_timestamp() - COALESCE(q.tokens_at,
                       clock_timestamp())))) AS available
              FROM {QUEUE_TABLE} AS q
             WHERE q.name = %(queue)s AND q.rate_per_second IS NOT NULL
               FOR UPDATE
        )
        UPDATE {QUEUE_TABLE} AS q
           SET tokens = bucket.available - CASE WHEN bucket.available >= 1 THEN 1 ELSE 0 END,
               tokens_at = clock_timestamp()
          FROM bucket WHERE q.name = bucket.name
     RETURNING CASE WHEN bucket.available >= 1 THEN 0.0
                    ELSE (1 - bucket.available) / bucket.rate END
        """,
        {"queue": queue},
    )
    return 0.0 if row is None else float(row[0])


class QueueFigures(NamedTuple):
    queue: str
    waiting: int  # pending outbox rows: held in PostgreSQL
    running: int


def queues_figures(
    *, queues: list[str], lanes: dict[str, str], replay_lane: str
) -> dict[str, QueueFigures]:
    """Per Celery queue (lanes are their own; `lanes`: run kind -> its lane's suffix,
    `replay_lane`: the suffix of replayed runs' lane, whatever their kind): pending outbox
    rows, and running runs. Counts; no lock."""
    waiting = dict(
        fetch_all(
            f"SELECT queue, count(*) FROM {OUTBOX_TABLE} WHERE state = %s AND queue = ANY(%s)"
            " GROUP BY queue",
            [PENDING, queues],
        )
    )
    running = dict(
        fetch_all(
            f"""
            SELECT COALESCE((v.spec->>'queue') || '.' || CASE WHEN r.replayed_at IS NOT NULL
                                THEN %(replay)s ELSE %(lanes)s::jsonb->>r.kind END,
                            v.spec->>'queue'), count(*)
              FROM {RUN_TABLE} AS r JOIN {VERSION_TABLE} AS v ON v.id = r.job_version_id
             WHERE r.state = 'running' GROUP BY 1
            """,
            {"lanes": json.dumps(lanes), "replay": replay_lane},
        )
    )
    return {
        queue: QueueFigures(queue, waiting.get(queue, 0), running.get(queue, 0)) for queue in queues
    }
