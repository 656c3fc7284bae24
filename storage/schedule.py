"""The materializer's write: a batch of due occurrences made runs, in one statement.

Tables: `jobs_run`, `dispatch_outboxmessage` (the outbox) and `jobs_job`.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import NamedTuple

from .sql import fetch_one

RUN = "jobs_run"
OUTBOX = "dispatch_outboxmessage"
JOB = "jobs_job"
SCHEDULED = "scheduled"  # jobs.models.RunKind.SCHEDULED
QUEUED, SKIPPED = "queued", "skipped"  # jobs.models.RunState
OUTBOX_PENDING = "pending"  # jobs.models.OutboxState.PENDING


class ScheduledRun(NamedTuple):
    """A scheduled run to create, with what its outbox row needs if it is `queued`."""

    id: uuid.UUID
    job_id: uuid.UUID
    job_version_id: int
    owner_id: int
    state: str
    scheduled_for: dt.datetime
    due_at: dt.datetime
    idempotency_key: str
    skip_reason: str
    finished_at: dt.datetime | None
    task_name: str
    queue: str
    priority: int
    timeout_seconds: int | None


class JobAdvance(NamedTuple):
    """A job's next occurrence after the ones made runs (None: its schedule is over)."""

    job_id: uuid.UUID
    next_run_at: dt.datetime | None


class ScheduledWrite(NamedTuple):
    created: int  # runs created to execute (queued or pending)
    skipped: int  # runs created `skipped`
    outboxed: int  # outbox rows written (one per queued run created)


def runs_write_scheduled(
    *, runs: list[ScheduledRun], jobs: list[JobAdvance], now: dt.datetime
) -> ScheduledWrite:
    """Create `runs`, an outbox row for each one created `queued` (in the order of `runs`:
    the relay publishes in id order, oldest first), and set each job's `next_run_at`: one
    statement. The runs go as one JSON document unpacked server-side; an occurrence that
    already has its scheduled run is passed over (ON CONFLICT on the one-per-occurrence
    index DO NOTHING), any other unique violation is an error. Runs in the caller's
    transaction, which holds the jobs' rows locked (the materializer's claim); takes the
    new rows' locks and those of the jobs it updates. The caller wakes the relays."""
    rows = [
        {"position": position, "id": str(run.id), "job_id": str(run.job_id),
         "job_version_id": run.job_version_id, "owner_id": run.owner_id, "state": run.state,
         "scheduled_for": run.scheduled_for.isoformat(), "due_at": run.due_at.isoformat(),
         "idempotency_key": run.idempotency_key, "skip_reason": run.skip_reason,
         "finished_at": run.finished_at.isoformat() if run.finished_at else None,
         "task_name": run.task_name, "queue": run.queue, "priority": run.priority,
         "timeout_seconds": run.timeout_seconds}
        for position, run in enumerate(runs)
    ]  # fmt: skip
    created, skipped, outboxed, _advanced = fetch_one(
        f"""
        WITH planned AS MATERIALIZED (
            SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS planned(
                position int, id uuid, job_id uuid, job_version_id bigint,
                owner_id bigint, state text,
                scheduled_for timestamptz, due_at timestamptz, idempotency_key text,
                skip_reason text, finished_at timestamptz, task_name text, queue text,
                priority int, timeout_seconds int)
        ), created AS (
            INSERT INTO {RUN}
                   (id, job_id, job_version_id, kind, state, scheduled_for,
                    idempotency_key, fencing_token, attempt_count, failure_reason,
                    skip_reason, due_at, created_at, finished_at, updated_at,
                    duplicate_deliveries, retry_base, republish_count)
            SELECT id, job_id, job_version_id, %(kind)s, state, scheduled_for,
                   idempotency_key, 0, 0, '', skip_reason, due_at, %(now)s, finished_at,
                   %(now)s, 0, 0, 0
              FROM planned
            ON CONFLICT (job_id, scheduled_for) WHERE kind = %(kind)s DO NOTHING
            RETURNING id, state
        ), outboxed AS (
            INSERT INTO {OUTBOX}
                   (run_id, owner_id, message_id, task_name, queue, priority,
                    timeout_seconds, state, created_at, publish_tries, last_error)
            SELECT planned.id, owner_id, gen_random_uuid(), task_name, queue, priority,
                   timeout_seconds, %(pending)s, %(now)s, 0, ''
              FROM created JOIN planned USING (id)
             WHERE created.state = %(queued)s
             ORDER BY planned.position  -- the relay publishes in id order: oldest first
            RETURNING 1
        ), advanced AS (
            UPDATE {JOB} AS job
               SET next_run_at = advanced.next_run_at
              FROM unnest(%(job_ids)s::uuid[], %(next_run_at)s::timestamptz[])
                   AS advanced (id, next_run_at)
             WHERE job.id = advanced.id
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM created WHERE state <> %(skipped)s),
               (SELECT count(*) FROM created WHERE state = %(skipped)s),
               (SELECT count(*) FROM outboxed),
               (SELECT count(*) FROM advanced)
        """,
        {
            "rows": json.dumps(rows), "kind": SCHEDULED, "now": now,
            "pending": OUTBOX_PENDING, "queued": QUEUED, "skipped": SKIPPED,
            "job_ids": [job.job_id for job in jobs],
            "next_run_at": [job.next_run_at for job in jobs],
        },
    )  # fmt: skip
    return ScheduledWrite(created=created, skipped=skipped, outboxed=outboxed)
