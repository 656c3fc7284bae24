"""The outbox: a task message per run to publish, written in the transaction of the state
change that needs it, claimed by a relay for a lease (`claimed_by`, `claimed_until`) in a
short transaction, and deleted by that relay in another once the broker confirmed it
(dispatch.relay). A row is `pending` for as long as it exists.

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
RUN_TABLE = "jobs_run"
JOB_TABLE = "jobs_job"
# jobs.models.OutboxState.PENDING, the only state a row has (the partial indexes name it).
PENDING = "pending"
# The type of an owner's id (auth_user.id), for arrays of owners.
OWNER_ID_TYPE = "integer"

# The columns every writer of outbox rows inserts, in the order outbox_insert_select fills.
OUTBOX_COLUMNS = (
    "run_id, owner_id, message_id, task_name, queue, priority, timeout_seconds,"
    " state, created_at, publish_tries, last_error, refused_since, claimed_by, claimed_until"
)


def outbox_insert_select(*, source: str, run_id: str, owner_id: str) -> str:
    """The head of every statement that writes outbox rows, `INSERT INTO <the outbox>
    (OUTBOX_COLUMNS) SELECT <a new pending row>`: `run_id` and `owner_id` are SQL
    expressions, the message's task_name, queue, priority and timeout_seconds are the
    columns of those names of the relation `source`; a new message id, created at the
    statement's `%(now)s` parameter, claimed by no relay. The writer appends its FROM
    (and ORDER BY, RETURNING)."""
    return f"""INSERT INTO {OUTBOX_TABLE} ({OUTBOX_COLUMNS})
        SELECT {run_id}, {owner_id}, gen_random_uuid(), {source}.task_name, {source}.queue,
               {source}.priority, {source}.timeout_seconds, '{PENDING}', %(now)s, 0, '', NULL,
               NULL, NULL"""


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
    """Delete the run's pending rows, so that they are never sent, passing over one a relay
    is claiming this instant (FOR UPDATE SKIP LOCKED: its claim's short transaction). A
    row a relay is publishing (claimed, no lock) is deleted: its message may still go, and
    the worker's claim refuses it (the run is no longer queued). Runs in the caller's
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


def outbox_delete_published(*, message_ids: list[int], claim: uuid.UUID | None = None) -> list[int]:
    """Delete the rows the broker confirmed, only those still held by the relay's `claim`
    (any claim if None): a row whose claim ran out and that another relay took is that
    relay's to delete. Runs in a short transaction of its own after the publication (the
    relay's), locking the rows it deletes. Returns the ids deleted."""
    held = "" if claim is None else "AND claimed_by = %(claim)s"
    rows = fetch_all(
        f"DELETE FROM {OUTBOX_TABLE} WHERE id = ANY(%(ids)s) {held} RETURNING id",
        {"ids": message_ids, "claim": claim},
    )
    return [row_id for (row_id,) in rows]


def outbox_claim_keep(*, message_ids: list[int], claim: uuid.UUID) -> list[int]:
    """The rows among `message_ids` still held by `claim`, locked FOR UPDATE until the
    caller's transaction ends (the relay's, recording a failed publication): a row another
    relay took since is left alone. Returns their ids."""
    rows = fetch_all(
        f"""
        SELECT id FROM {OUTBOX_TABLE}
         WHERE id = ANY(%(ids)s) AND claimed_by = %(claim)s
         ORDER BY id FOR UPDATE
        """,
        {"ids": message_ids, "claim": claim},
    )
    return [row_id for (row_id,) in rows]


def outbox_record_failed_try(
    *, message_ids: list[int], error: str, refused_at: dt.datetime | None = None
) -> int:
    """Count a failed publication of these pending rows and keep its error: they stay
    pending for the next try, their claim given up (any relay may take them at once).
    `refused_at`: the time of a refusal that lasts until an operator acts, kept in
    `refused_since` unless the rows were refused so already; None for any other failure
    (an outage, a refusal that can pass), which empties it. Runs in the caller's
    transaction; locks the rows it updates. Returns the rows updated."""
    return execute(
        f"""
        UPDATE {OUTBOX_TABLE} SET publish_tries = publish_tries + 1, last_error = %(error)s,
               refused_since = CASE WHEN %(refused_at)s::timestamptz IS NOT NULL
                                    THEN COALESCE(refused_since, %(refused_at)s) END,
               claimed_by = NULL, claimed_until = NULL
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


# Seconds a relay's claim on the rows it publishes lasts by default (dispatch.relay's
# RelayConfig.claim_lease): longer than a batch's publication and confirm wait.
CLAIM_LEASE_SECONDS = 30.0


def outbox_claim_pending(
    *,
    queue: str,
    quotas: dict[int, int],
    exclude: list[int],
    claim: uuid.UUID | None = None,
    lease_seconds: float = CLAIM_LEASE_SECONDS,
) -> list[PendingMessage]:
    """Claim the queue's pending rows: up to its quota of each owner's (owner id -> quota),
    by priority then oldest first, passing over the ids in `exclude` (claimed earlier in
    the same step) and the rows another relay's claim holds. Each row claimed is stamped
    `claimed_by` = `claim` (a new one if None) until `lease_seconds` from the database's
    clock; a row whose claim ran out is claimable again. Runs in the caller's short
    transaction (the relay's claim, committed before it publishes) and locks the rows FOR
    UPDATE SKIP LOCKED until then: relays claiming at once split the work. One index range
    per owner (outbox_pending_idx), reading past at most the rows being published. The
    rows come owner by owner in the quotas' order, each owner's by priority, then oldest
    first."""
    rows = fetch_all(
        f"""
        WITH picked AS (
            SELECT m.id
              FROM unnest(%(owners)s::{OWNER_ID_TYPE}[], %(quotas)s::int[])
                   AS share (owner, quota)
             CROSS JOIN LATERAL (
                   SELECT pending.id FROM {OUTBOX_TABLE} AS pending
                    WHERE pending.state = %(pending)s AND pending.queue = %(queue)s
                      AND pending.owner_id = share.owner AND pending.id <> ALL(%(exclude)s)
                      AND (pending.claimed_until IS NULL OR pending.claimed_until < now())
                    ORDER BY pending.priority DESC, pending.id
                    LIMIT share.quota
                      FOR UPDATE SKIP LOCKED
                   ) AS m
        )
        , claimed AS (
            UPDATE {OUTBOX_TABLE} AS m
               SET claimed_by = %(claim)s,
                   claimed_until = now() + make_interval(secs => %(lease)s)
              FROM picked WHERE m.id = picked.id
            RETURNING m.id, m.message_id, m.run_id, m.task_name, m.queue, m.priority,
                      m.timeout_seconds, m.created_at, m.owner_id
        )
        SELECT * FROM claimed
         ORDER BY array_position(%(owners)s::{OWNER_ID_TYPE}[], owner_id), priority DESC, id
        """,
        {"owners": list(quotas), "quotas": list(quotas.values()), "queue": queue,
         "pending": PENDING, "exclude": exclude, "claim": claim or uuid.uuid4(),
         "lease": lease_seconds},
    )  # fmt: skip
    return [PendingMessage(*row) for row in rows]


def outbox_renumber_in_due_order(*, queues: list[str]) -> int:
    """Give these queues' pending rows that no relay's live claim holds new ids in the
    order of their runs' due instants (`scheduled_for`, then the old id), so that the
    relays' claims, oldest id first within a priority, publish them in due order: a row
    written when its run was handed back (after the rows already waiting) goes back to its
    run's place. Each row is moved whole (same message id, tries, errors) in one statement,
    in the caller's transaction (a queue's resume); locks the rows it moves, passing over
    those a relay is claiming this instant (SKIP LOCKED). Returns the rows moved."""
    return execute(
        f"""
        WITH moved AS (
            DELETE FROM {OUTBOX_TABLE} WHERE id IN (
                SELECT id FROM {OUTBOX_TABLE}
                 WHERE state = %(pending)s AND queue = ANY(%(queues)s)
                   AND (claimed_until IS NULL OR claimed_until < now())
                   FOR UPDATE SKIP LOCKED)
            RETURNING *
        )
        INSERT INTO {OUTBOX_TABLE} ({OUTBOX_COLUMNS})
        SELECT moved.run_id, moved.owner_id, moved.message_id, moved.task_name, moved.queue,
               moved.priority, moved.timeout_seconds, moved.state, moved.created_at,
               moved.publish_tries, moved.last_error, moved.refused_since, NULL, NULL
          FROM moved JOIN {RUN_TABLE} AS run ON run.id = moved.run_id
         ORDER BY run.scheduled_for, moved.id
        """,
        {"pending": PENDING, "queues": queues},
    )
