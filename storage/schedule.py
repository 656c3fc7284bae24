"""The materializer's statements: the claim of due jobs, and the write that makes a batch
of their due occurrences runs, in one statement each.

Tables: `jobs_job`, `jobs_jobversion`, `jobs_run` and the outbox (its rows written by
storage.outbox.outbox_insert_select's head).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from typing import NamedTuple

from .outbox import outbox_insert_select
from .partitions import held_partitions_sql, in_held_partitions_sql, job_partition_sql
from .sql import fetch_all, fetch_one

RUN = "jobs_run"
JOB = "jobs_job"
JOB_VERSION = "jobs_jobversion"
ACTIVE = "active"  # jobs.models.JobState.ACTIVE
SCHEDULED = "scheduled"  # jobs.models.RunKind.SCHEDULED
QUEUED, SKIPPED = "queued", "skipped"  # jobs.models.RunState


@dataclasses.dataclass(slots=True)
class DueJob:
    """A claimed job as the materializer reads it, its row locked until the pass commits:
    its current version's spec included, read once. Not a model instance (three of them a
    run were most of a pass's CPU); mutable, as the pass advances its next_run_at."""

    id: uuid.UUID
    state: str
    version_id: int
    spec: dict
    next_run_at: dt.datetime | None
    created_at: dt.datetime
    resumed_at: dt.datetime | None
    owner_id: int


def jobs_due_claim(
    *, now: dt.datetime, limit: int, holder: str | None = None, partitions: int = 0
) -> list[DueJob]:
    """Up to `limit` active jobs due by `now`, each with its current version's spec, their
    rows locked until the caller's transaction ends: one statement. Its inner query claims
    the jobs' ids through `job_due_idx` in due order, FOR UPDATE SKIP LOCKED (a job another
    replica's pass holds is passed over), with a `holder` only those of the partitions
    whose lease it holds (of the first `partitions`) at the statement's start, on the
    database's clock (due jobs of other partitions are passed over, so the cost grows
    with due work); the outer one reads them with their versions, locking them again
    (already ours) FOR UPDATE OF the job, so that it reads each job's latest row. Only ids
    are sorted, so statistics that lag behind a burst cannot make it sort every due job's
    spec on disk. Run it in the transaction that writes the runs."""
    held = ""
    if holder is not None:
        partition = job_partition_sql("due.id", "%(partitions)s")
        held = "AND " + in_held_partitions_sql(
            partition, held_partitions_sql("%(holder)s", "%(partitions)s")
        )
    rows = fetch_all(
        f"""
        SELECT job.id, job.state, version.id, version.spec,
               job.next_run_at, job.created_at, job.resumed_at, job.owner_id
          FROM {JOB} AS job
          JOIN {JOB_VERSION} AS version ON version.job_id = job.id
         WHERE job.id IN (SELECT due.id FROM {JOB} AS due
                           WHERE due.next_run_at <= %(now)s AND due.state = %(active)s
                                 {held}
                           ORDER BY due.next_run_at
                           LIMIT %(limit)s
                             FOR UPDATE SKIP LOCKED)
           AND version.version = job.version
           FOR UPDATE OF job
        """,
        {"now": now, "active": ACTIVE, "limit": limit, "holder": holder,
         "partitions": partitions},
    )  # fmt: skip
    # jsonb comes back as text on Django's connections (its JSONField decodes it).
    return [DueJob(*row[:3], json.loads(row[3]), *row[4:]) for row in rows]


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
            ON CONFLICT (job_id, scheduled_for) WHERE kind = '{SCHEDULED}' DO NOTHING
            RETURNING id, state
        ), outboxed AS (
            {outbox_insert_select(source="planned", run_id="planned.id",
                                  owner_id="planned.owner_id")}
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
            "queued": QUEUED, "skipped": SKIPPED,
            "job_ids": [job.job_id for job in jobs],
            "next_run_at": [job.next_run_at for job in jobs],
        },
        # Bound on the server: the document and the arrays go as they are (client-side
        # binding escaped them in Python), the statement planned once per connection.
        prepared=True,
    )  # fmt: skip
    return ScheduledWrite(created=created, skipped=skipped, outboxed=outboxed)
