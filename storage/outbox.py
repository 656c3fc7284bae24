"""The outbox: a task message per run to publish, written in the transaction of the state
change that needs it and deleted by a relay in the transaction that saw the broker confirm
it (dispatch.relay). A row is `pending` for as long as it exists.

Every statement that writes outbox rows starts with `outbox_insert_select`, the one place
that lists the outbox's columns and what a new row holds in each: `outbox_enqueue_many`
here, and the scheduler's statement that writes runs and their rows together.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from typing import NamedTuple

from .sql import execute, fetch_all

OUTBOX_TABLE = "dispatch_outboxmessage"
ACTIVE_RUN_TABLE = "jobs_activerun"
JOB_TABLE = "jobs_job"
# jobs.models.OutboxState.PENDING, the only state a row has (the partial indexes name it).
PENDING = "pending"
# The type of an owner's id (auth_user.id), for arrays of owners.
OWNER_ID_TYPE = "integer"

# The columns every writer of outbox rows inserts, in the order outbox_insert_select fills.
OUTBOX_COLUMNS = (
    "run_id, owner_id, message_id, task_name, queue, priority, timeout_seconds,"
    " state, created_at, publish_tries, last_error, refused_since"
)


def outbox_insert_select(*, source: str, run_id: str, owner_id: str) -> str:
    """The head of every statement that writes outbox rows, `INSERT INTO <the outbox>
    (OUTBOX_COLUMNS) SELECT <a new pending row>`: `run_id` and `owner_id` are SQL
    expressions, the message's task_name, queue, priority and timeout_seconds are the
    columns of those names of the relation `source`; a new message id, created at the
    statement's `%(now)s` parameter. The writer appends its FROM (and ORDER BY, RETURNING)."""
    return f"""INSERT INTO {OUTBOX_TABLE} ({OUTBOX_COLUMNS})
        SELECT {run_id}, {owner_id}, gen_random_uuid(), {source}.task_name, {source}.queue,
               {source}.priority, {source}.timeout_seconds, '{PENDING}', %(now)s, 0, '', NULL"""


class OutboxEntry(NamedTuple):
    """The message of one run, as its writer knows it (the owner is its job's)."""

    run_id: uuid.UUID
    job_id: uuid.UUID
    task_name: str
    queue: str
    priority: int
    timeout_seconds: int | None


@dataclasses.dataclass(frozen=True)
class PendingMessage:
    """What a relay reads of a pending row it claimed."""

    id: int
    message_id: uuid.UUID
    run_id: uuid.UUID
    task_name: str
    queue: str
    priority: int
    timeout_seconds: int | None
    created_at: dt.datetime | None = None
    owner_id: int | None = None


def outbox_enqueue_many(*, entries: list[OutboxEntry], now: dt.datetime) -> int:
    """Write one pending row per entry, owned by its job's owner, in one statement; the
    entries' runs lose their ActiveRun rows in the same statement (a run waiting in the
    outbox again does not count against its owner's limit). Runs in the caller's
    transaction (the state change's); takes no lock beyond the rows it writes and deletes.
    Returns the rows written."""
    if not entries:
        return 0
    # One JSON document unpacked server-side: no per-row conversion or array quoting, which
    # at thousands of runs a second were most of the writer's time.
    document = json.dumps([
        {"run_id": str(entry.run_id), "job_id": str(entry.job_id), "task_name": entry.task_name,
         "queue": entry.queue, "priority": entry.priority,
         "timeout_seconds": entry.timeout_seconds}
        for entry in entries
    ])  # fmt: skip
    return execute(
        f"""
        WITH message AS MATERIALIZED (
            SELECT * FROM jsonb_to_recordset(%(messages)s::jsonb)
                AS message(run_id uuid, job_id uuid, task_name text, queue text,
                           priority int, timeout_seconds int)
        ), uncounted AS (
            DELETE FROM {ACTIVE_RUN_TABLE}
             WHERE run_id IN (SELECT run_id FROM message)
        )
        {outbox_insert_select(source="message", run_id="message.run_id", owner_id="job.owner_id")}
          FROM message JOIN {JOB_TABLE} AS job ON job.id = message.job_id
        """,
        {"messages": document, "now": now},
    )


def outbox_discard_pending(*, run_id: uuid.UUID) -> int:
    """Delete the run's pending rows that no relay holds (FOR UPDATE SKIP LOCKED), so that
    they are never sent; one a relay is publishing right now stays. Runs in the caller's
    transaction (the cancel's). Returns the rows deleted."""
    return execute(
        f"""
        DELETE FROM {OUTBOX_TABLE} WHERE id IN (
            SELECT id FROM {OUTBOX_TABLE}
             WHERE run_id = %(run_id)s AND state = %(pending)s
               FOR UPDATE SKIP LOCKED)
        """,
        {"run_id": run_id, "pending": PENDING},
    )


def outbox_delete_published(*, message_ids: list[int]) -> int:
    """Delete the rows the broker confirmed. Runs in the transaction of the relay step that
    claimed them (which holds their row locks). Returns the rows deleted."""
    return execute(f"DELETE FROM {OUTBOX_TABLE} WHERE id = ANY(%s)", [message_ids])


def outbox_record_failed_try(
    *, message_ids: list[int], error: str, refused_at: dt.datetime | None = None
) -> int:
    """Count a failed publication of these pending rows and keep its error: they stay
    pending for the next try. `refused_at`: the time of a refusal that lasts until an
    operator acts, kept in `refused_since` unless the rows were refused so already; None
    for any other failure (an outage, a refusal that can pass), which empties it. Runs in
    the caller's transaction; locks the rows it updates. Returns the rows updated."""
    return execute(
        f"""
        UPDATE {OUTBOX_TABLE} SET publish_tries = publish_tries + 1, last_error = %(error)s,
               refused_since = CASE WHEN %(refused_at)s::timestamptz IS NOT NULL
                                    THEN COALESCE(refused_since, %(refused_at)s) END
         WHERE id = ANY(%(ids)s) AND state = %(pending)s
        """,
        {"ids": message_ids, "error": error, "refused_at": refused_at, "pending": PENDING},
    )


def outbox_pending_queues(*, limit: int) -> list[str]:
    """The queues that have pending rows (at most `limit`, in order of name), found by
    skipping through the pending index, one probe per queue, whatever the number of rows
    waiting (a loose index scan). Takes no lock."""
    rows = fetch_all(
        f"""
        WITH RECURSIVE queues (queue) AS (
            (SELECT queue FROM {OUTBOX_TABLE} WHERE state = %(pending)s ORDER BY queue LIMIT 1)
            UNION ALL
            SELECT (SELECT o.queue FROM {OUTBOX_TABLE} AS o
                     WHERE o.state = %(pending)s AND o.queue > queues.queue
                     ORDER BY o.queue LIMIT 1)
              FROM queues WHERE queues.queue IS NOT NULL
        )
        SELECT queue FROM queues WHERE queue IS NOT NULL LIMIT %(limit)s
        """,
        {"pending": PENDING, "limit": limit},
    )
    return [queue for (queue,) in rows]


def outbox_claim_pending(
    *, queue: str, quotas: dict[int, int], exclude: list[int]
) -> list[PendingMessage]:
    """Claim the queue's pending rows: up to its quota of each owner's (owner id -> quota),
    by priority then oldest first, passing over the ids in `exclude` (claimed earlier in
    the same step). Runs in the caller's transaction (the relay step's, which deletes the
    rows once the broker confirmed them) and locks the rows FOR UPDATE SKIP LOCKED: rows
    another relay holds are passed over, so relays split the work. One index range per
    owner (outbox_pending_idx). The rows come owner by owner, in no other order."""
    rows = fetch_all(
        f"""
        SELECT m.id, m.message_id, m.run_id, m.task_name, m.queue, m.priority,
               m.timeout_seconds, m.created_at, m.owner_id
          FROM unnest(%(owners)s::{OWNER_ID_TYPE}[], %(quotas)s::int[]) AS share (owner, quota)
         CROSS JOIN LATERAL (
               SELECT * FROM {OUTBOX_TABLE} AS pending
                WHERE pending.state = %(pending)s AND pending.queue = %(queue)s
                  AND pending.owner_id = share.owner AND pending.id <> ALL(%(exclude)s)
                ORDER BY pending.priority DESC, pending.id
                LIMIT share.quota
                  FOR UPDATE SKIP LOCKED
               ) AS m
        """,
        {"owners": list(quotas), "quotas": list(quotas.values()), "queue": queue,
         "pending": PENDING, "exclude": exclude},
    )  # fmt: skip
    return [PendingMessage(*row) for row in rows]
