"""Writing outbox rows, always inside the transaction of the state change that needs them.

A row exists only while its message waits to be published: the relay deletes it in the
transaction that saw the broker confirm it (`outbox_delete_published`).
"""

import datetime as dt

from django.db import connection
from django.db.models import F

from .models import OutboxMessage, OutboxState, Run
from .notify import CHANNEL_OUTBOX, notify


def outbox_enqueue_runs(*, runs: list[Run], now: dt.datetime) -> list[OutboxMessage]:
    """One task message per run; `run.job_version` must be loaded. The relays are woken
    when the transaction commits."""
    messages = [
        OutboxMessage(
            run_id=run.id,
            task_name=run.job_version.spec["task"],
            queue=run.job_version.spec["queue"],
            priority=run.job_version.spec["priority"],
            timeout_seconds=run.job_version.spec.get("timeout_seconds"),
            created_at=now,
        )
        for run in runs
    ]
    if not messages:
        return []
    created = OutboxMessage.objects.bulk_create(messages)
    notify(CHANNEL_OUTBOX)
    return created


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
        publish_tries=F("publish_tries") + 1, last_error=repr(error)[:2000]
    )
