"""Runs: the claim of a delivered run and the reservation of a packed message's runs;
reconciliation's mark of the queued runs held back in the outbox (`runs_mark_held`).

Each statement moves runs from `queued` to `running` and inserts their attempts in one
statement, atomic without a transaction block of its own: the compare-and-set that issues
the next fencing token, the read of the run's spec and the attempt's insert.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any, NamedTuple

from django.db import connection

from .queues import PAUSED_IN_FORCE, QUEUE_TABLE
from .sql import prepared_cursor


class ClaimedRun(NamedTuple):
    """A run a claim (or a reservation) moved to `running`, as its statement returned it,
    with the attempt it made: a worker needs nothing more before it runs the handler."""

    id: uuid.UUID
    job_id: uuid.UUID
    job_version_id: int
    kind: str
    scheduled_for: dt.datetime
    idempotency_key: str
    fencing_token: int
    attempt_count: int
    retry_base: int
    spec: dict
    now: dt.datetime  # the database's clock at the claim
    lease_expires_at: dt.datetime
    deadline_at: dt.datetime | None
    attempt_id: int


# The columns of the run a claim's (or a reservation's) update returns, aliased `r`.
_CLAIMED_RETURNING = (
    "r.id, r.job_id, r.job_version_id, r.kind, r.scheduled_for, r.idempotency_key,"
    " r.fencing_token, r.attempt_count, r.retry_base"
)
# The columns a claim's (or a reservation's) attempt insert writes.
_ATTEMPT_INSERT_COLUMNS = (
    "run_id, number, fencing_token, state, worker, claim_id, lease_expires_at, deadline_at,"
    " heartbeat_at, started_at, error, task_id"
)

# The gate a claim passes when `gated`: the control row of the run's queue, if it has one,
# share-locked until the claim's transaction ends (a pause, which updates it, waits for
# the claim), and `held` when it is paused now, capped or rate-limited (those go through
# dispatch.queues instead). An uncorrelated subquery: evaluated once, before the run's
# row is locked, the order dispatch.queues takes the two locks in.
_GATE = f"""
    gate AS (
        SELECT {PAUSED_IN_FORCE} OR q.max_running IS NOT NULL
               OR q.rate_per_second IS NOT NULL AS held
          FROM jobs_run AS r0 JOIN jobs_jobversion AS v0 ON v0.id = r0.job_version_id
          JOIN {QUEUE_TABLE} AS q ON q.name = v0.spec->>'queue'
         WHERE r0.id = %(run_id)s::uuid
           FOR SHARE OF q
    ),"""


def _claim_statement(*, gated: bool) -> str:
    return f"""
    WITH clock AS (SELECT COALESCE(%(now)s::timestamptz, clock_timestamp()) AS now),
    {_GATE if gated else ""}
    claimed AS (
        UPDATE jobs_run AS r
           SET state = 'running', fencing_token = r.fencing_token + 1,
               attempt_count = r.attempt_count + 1, updated_at = clock.now,
               started_at = COALESCE(r.started_at, clock.now), next_attempt_at = NULL,
               published_at = COALESCE(r.published_at, %(published_at)s::timestamptz)
          FROM clock
         WHERE r.id = %(run_id)s::uuid AND r.state = ANY(%(from_states)s::text[])
           {"AND NOT EXISTS (SELECT 1 FROM gate WHERE gate.held)" if gated else ""}
     RETURNING {_CLAIMED_RETURNING}, clock.now
    ),
    timed AS (
        SELECT claimed.*, v.spec,
               claimed.now + make_interval(secs => COALESCE(
                   %(lease)s::float8, (v.spec->>'heartbeat_timeout_seconds')::float8
               )) AS lease_expires_at,
               claimed.now + make_interval(secs => COALESCE(
                   %(timeout)s::float8, (v.spec->>'timeout_seconds')::float8
               )) AS deadline_at
          FROM claimed JOIN jobs_jobversion AS v ON v.id = claimed.job_version_id
    ),
    attempt AS (
        INSERT INTO jobs_attempt ({_ATTEMPT_INSERT_COLUMNS})
        SELECT id, attempt_count, fencing_token, 'running', %(worker)s::text,
               %(claim_id)s::uuid, lease_expires_at, deadline_at, now, now, '', %(task_id)s::text
          FROM timed
     RETURNING id
    )
    SELECT timed.*, attempt.id AS attempt_id FROM timed CROSS JOIN attempt
"""


_CLAIM = _claim_statement(gated=False)
_CLAIM_GATED = _claim_statement(gated=True)


def run_claim(
    *,
    run_id: uuid.UUID | str,
    worker: str,
    claim_id: uuid.UUID | None,
    now: dt.datetime | None = None,
    lease_seconds: float | None = None,
    timeout_seconds: float | None = None,
    published_at: dt.datetime | None = None,
    task_id: str = "",
    gated: bool = False,
) -> ClaimedRun | None:
    """queued -> running for one run, with a new attempt holding the next fencing token, a
    lease and a deadline, started now; None when the run is not queued (a duplicate
    delivery, a cancelled or unknown run). `now` defaults to the database's clock
    (clock_timestamp()); `lease_seconds` and `timeout_seconds` to the spec's heartbeat and
    run timeouts; `published_at` stamps the run's first publication.

    One statement, in its own implicit transaction or the caller's; takes the run's row
    lock (the conditional UPDATE: a concurrent claim waits, then finds it `running` and
    changes nothing).

    `gated`: only when the run's queue has no control in force (no control row, or one
    neither paused now nor capped nor rate-limited), whose row the statement share-locks
    (_GATE); None otherwise too, and the caller goes through the queue's gate
    (dispatch.queues), which this one statement saves the uncontrolled queues."""
    params = {
        "run_id": _uuid(run_id),
        "worker": worker,
        "claim_id": claim_id,
        "now": now,
        "lease": lease_seconds,
        "timeout": timeout_seconds,
        "published_at": published_at,
        "task_id": task_id,
        "from_states": ["queued"],
    }
    rows = _claimed(_CLAIM_GATED if gated else _CLAIM, params)
    return rows[0] if rows else None


_RESERVE = f"""
    WITH clock AS (SELECT clock_timestamp() AS now),
    pack AS (
        SELECT * FROM unnest(%(run_ids)s::uuid[]) WITH ORDINALITY AS p(run_id, position)
    ),
    locked AS (  -- in the order of their ids, as every multi-run update locks them
        SELECT r.id FROM jobs_run AS r JOIN pack ON r.id = pack.run_id
         WHERE r.state = ANY(%(from_states)s::text[]) AND r.attempt_count = 0
         ORDER BY r.id FOR UPDATE OF r
    ),
    claimed AS (
        UPDATE jobs_run AS r
           SET state = 'running', fencing_token = r.fencing_token + 1,
               attempt_count = r.attempt_count + 1, updated_at = clock.now,
               next_attempt_at = NULL,
               published_at = COALESCE(r.published_at, %(published_at)s::timestamptz)
          FROM clock, pack, jobs_jobversion AS v
         WHERE r.id = pack.run_id AND r.id IN (SELECT id FROM locked)
           AND r.state = ANY(%(from_states)s::text[]) AND r.attempt_count = 0
           AND v.id = r.job_version_id
           AND COALESCE(v.spec->>'delivery', '') <> 'at_most_once'
     RETURNING {_CLAIMED_RETURNING},
               clock.now, pack.position, v.spec,
               clock.now + make_interval(
                   secs => (v.spec->>'heartbeat_timeout_seconds')::float8
               ) AS lease_expires_at,
               (v.spec->>'timeout_seconds')::float8 AS timeout
    ),
    bounded AS (
        -- The latest a reserved run can end: after every run before it in the pack
        -- ran to its own limit and grace, and it to its own limit; none when one of
        -- them has no limit.
        SELECT claimed.*, CASE WHEN bool_and(timeout IS NOT NULL) OVER upto
               THEN now + make_interval(
                   secs => sum(timeout + %(grace)s::float8) OVER upto - %(grace)s::float8
               ) END AS deadline_at
          FROM claimed
        WINDOW upto AS (ORDER BY position ROWS UNBOUNDED PRECEDING)
    ),
    attempt AS (
        INSERT INTO jobs_attempt ({_ATTEMPT_INSERT_COLUMNS})
        SELECT id, attempt_count, fencing_token, 'running', %(worker)s::text,
               %(claim_id)s::uuid, lease_expires_at, deadline_at, now, NULL, '', %(task_id)s::text
          FROM bounded ORDER BY position
     RETURNING id, run_id
    )
    SELECT bounded.*, attempt.id AS attempt_id
      FROM bounded JOIN attempt ON attempt.run_id = bounded.id ORDER BY attempt.id
"""


def runs_reserve(
    *,
    run_ids: list[uuid.UUID | str],
    worker: str,
    claim_id: uuid.UUID,
    published_at: dt.datetime | None = None,
    task_id: str = "",
    grace_seconds: float = 0.0,
) -> list[ClaimedRun]:
    """queued -> running for the first attempts of a packed message's runs that are not
    `at_most_once`: each gets its own attempt, token and lease, but no start (`started_at`
    NULL: reserved), and as deadline the latest instant it can end (every run before it in
    the pack at its limit plus `grace_seconds`, and itself at its limit). The runs made, in
    the order of their attempts' ids (the pack's order).

    One statement, in its own implicit transaction or the caller's; locks the pack's
    claimable runs FOR UPDATE in the order of their ids (the order every multi-run update
    takes them in), so two reservations of overlapping packs never deadlock and a run is
    reserved by one of them only."""
    if not run_ids:
        return []
    params = {
        "run_ids": [_uuid(run_id) for run_id in run_ids],
        "worker": worker,
        "claim_id": claim_id,
        "published_at": published_at,
        "task_id": task_id,
        "from_states": ["queued"],
        "grace": float(grace_seconds),
    }
    return _claimed(_RESERVE, params)


def _claimed(statement: str, params: dict[str, Any]) -> list[ClaimedRun]:
    with prepared_cursor() as cursor:
        cursor.execute(statement, params)
        names = [column.name for column in cursor.description]
        rows = [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]
    return [
        ClaimedRun(
            **{
                **{field: row[field] for field in ClaimedRun._fields},
                # Django has psycopg hand jsonb over as text.
                "spec": json.loads(row["spec"]) if isinstance(row["spec"], str) else row["spec"],
            }
        )
        for row in rows
    ]


def _uuid(value: uuid.UUID | str) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


RUN_TABLE = "jobs_run"
OUTBOX_TABLE = "dispatch_outboxmessage"
# run_queued_unheld_idx's predicate, as the ORM writes it (jobs.models.Run): a statement
# that says it the same way is served by the index.
QUEUED_UNHELD = "r.state = 'queued' AND NOT (r.held_at = r.updated_at AND r.held_at IS NOT NULL)"


def runs_mark_held(
    *,
    updated_before: dt.datetime,
    pending_before: dt.datetime,
    limit: int,
    ids: list[uuid.UUID] | None = None,
) -> int:
    """Mark as held back the queued runs whose message still waits in the outbox (a pending
    row written before `pending_before`): `held_at` set to their `updated_at`, which takes
    them out of run_queued_unheld_idx until that is stamped again. Looks at the oldest
    `limit` unmarked queued runs last stamped before `updated_before` (or at those among
    `ids`), read from run_queued_unheld_idx, each with one probe of the outbox by run.
    Its conditions are checked again on the row as locked: a run published (and so
    stamped) meanwhile is left alone. Runs in its own statement; locks the rows it marks,
    passing over rows locked by others (SKIP LOCKED). Returns the runs marked."""
    among = "" if ids is None else "AND r.id = ANY(%(ids)s)"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH oldest AS (
                SELECT r.id FROM {RUN_TABLE} AS r
                 WHERE {QUEUED_UNHELD} AND r.updated_at < %(updated_before)s {among}
                 ORDER BY r.updated_at, r.id
                 LIMIT %(limit)s
            ), held AS (
                SELECT r.id FROM {RUN_TABLE} AS r
                 WHERE r.id = ANY(ARRAY(SELECT id FROM oldest))
                   AND {QUEUED_UNHELD} AND r.updated_at < %(updated_before)s
                   AND EXISTS (SELECT FROM {OUTBOX_TABLE} AS o
                                WHERE o.run_id = r.id AND o.created_at < %(pending_before)s)
                   FOR UPDATE OF r SKIP LOCKED
            )
            UPDATE {RUN_TABLE} AS r SET held_at = r.updated_at
             WHERE r.id = ANY(ARRAY(SELECT id FROM held))
            """,
            {"updated_before": updated_before, "pending_before": pending_before,
             "limit": limit, "ids": ids},
        )  # fmt: skip
        return cursor.rowcount
