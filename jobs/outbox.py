"""Writing outbox rows, always inside the transaction of the state change that needs them.

A row exists only while its message waits to be published: the relay deletes it in the
transaction that saw the broker confirm it (`outbox_delete_published`).
"""

import datetime as dt
import json

from django.db import connection
from django.db.models import Case, F, TextField, Value, When
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Concat

from .lanes import LANES, lane_queue
from .models import ActiveRun, Job, OutboxMessage, OutboxState, Run
from .notify import CHANNEL_OUTBOX, notify
from .redaction import redact


def run_lane_queue():
    """The Celery queue of a run (jobs.lanes.lane_queue) as an expression over Run rows:
    its version's `queue`, with the lane of its kind."""
    queue = KeyTextTransform("queue", "job_version__spec")
    text = TextField()
    return Case(
        *(When(kind=kind, then=Concat(queue, Value(f".{lane}"), output_field=text))
          for kind, lane in LANES.items()),
        default=queue,
        output_field=text,
    )  # fmt: skip


def outbox_enqueue_runs(*, runs: list[Run], now: dt.datetime) -> int:
    """One task message per run (`run.job_version` must be loaded), in one INSERT, to the
    lane of the run's kind (jobs.lanes); the relays are woken when the transaction commits.
    Returns the rows written.

    Every run queued again (retry, replay, reconciliation's republication) passes through
    here, and its ActiveRun row goes in the same statement: the run waits in the outbox
    again, and counting it against its owner's limit would hold back its own publication
    (dispatch.shares). The relay counts it again when it publishes it."""
    if not runs:
        return 0
    specs = [run.job_version.spec for run in runs]
    if connection.vendor != "postgresql":
        ActiveRun.objects.filter(run_id__in=[run.id for run in runs]).delete()
        owners = dict(
            Job.objects.filter(id__in={run.job_id for run in runs}).values_list("id", "owner_id")
        )
        OutboxMessage.objects.bulk_create(
            OutboxMessage(
                run_id=run.id,
                owner_id=owners[run.job_id],
                task_name=spec["task"],
                queue=lane_queue(spec["queue"], run.kind),
                priority=spec["priority"],
                timeout_seconds=spec.get("timeout_seconds"),
                created_at=now,
            )
            for run, spec in zip(runs, specs, strict=True)
        )
        return len(runs)  # SQLite: no NOTIFY, the relay polls
    # The rows as one JSON document unpacked server-side (jobs.rows): no model instance,
    # per-field conversion or array quoting per row, which at thousands of runs a second
    # were most of the writer's time.
    rows = [
        {"run_id": str(run.id), "job_id": str(run.job_id), "task_name": spec["task"],
         "queue": lane_queue(spec["queue"], run.kind),
         "priority": spec["priority"], "timeout_seconds": spec.get("timeout_seconds")}
        for run, spec in zip(runs, specs, strict=True)
    ]  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH message AS MATERIALIZED (
                SELECT * FROM jsonb_to_recordset(%s::jsonb)
                    AS message(run_id uuid, job_id uuid, task_name text, queue text,
                               priority int, timeout_seconds int)
            ), uncounted AS (
                DELETE FROM {ActiveRun._meta.db_table}
                 WHERE run_id IN (SELECT run_id FROM message)
            )
            INSERT INTO {OutboxMessage._meta.db_table}
                   (run_id, owner_id, message_id, task_name, queue, priority, timeout_seconds,
                    state, created_at, publish_tries, last_error)
            SELECT message.run_id, job.owner_id, gen_random_uuid(), message.task_name,
                   message.queue, message.priority, message.timeout_seconds, %s, %s, 0, ''
              FROM message JOIN {Job._meta.db_table} AS job ON job.id = message.job_id
            """,
            [json.dumps(rows), OutboxState.PENDING, now],
        )
        written = cursor.rowcount
    notify(CHANNEL_OUTBOX)
    return written


def outbox_discard_pending(*, run_id) -> int:
    """Delete a cancelled run's pending rows that no relay holds, so they are never sent;
    one a relay is publishing right now is sent, and the worker refuses to claim it."""
    unsent = OutboxMessage.objects.select_for_update(skip_locked=True).filter(
        run_id=run_id, state=OutboxState.PENDING
    )
    return OutboxMessage.objects.filter(id__in=[m.id for m in unsent]).delete()[0]


def outbox_delete_published(*, message_ids: list) -> int:
    """The broker confirmed these rows (the caller holds their locks): they are done."""
    if connection.vendor != "postgresql":
        return OutboxMessage.objects.filter(id__in=message_ids).delete()[0]
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {OutboxMessage._meta.db_table} WHERE id = ANY(%s)", [message_ids]
        )
        return cursor.rowcount


def outbox_record_failure(*, message_ids: list, error: BaseException) -> int:
    """These rows stay pending for the next try; their tries and last error make it visible."""
    return OutboxMessage.objects.filter(id__in=message_ids, state=OutboxState.PENDING).update(
        publish_tries=F("publish_tries") + 1, last_error=redact(repr(error))[:2000]
    )
