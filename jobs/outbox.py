"""Writing outbox rows, always inside the transaction of the state change that needs them."""

import datetime as dt

from .models import OutboxMessage, Run


def outbox_enqueue_runs(*, runs: list[Run], now: dt.datetime) -> list[OutboxMessage]:
    """One task message per run; `run.job_version` must be loaded."""
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
    return OutboxMessage.objects.bulk_create(messages)
