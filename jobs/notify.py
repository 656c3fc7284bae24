"""Wake-ups through PostgreSQL's LISTEN/NOTIFY, so that a sleeping loop starts on new work at
once instead of at its next poll. A writer notifies inside the transaction that made the
work: PostgreSQL delivers the notification at commit, drops it on rollback, and folds
repeats of the same channel and payload in one transaction into one. Polling stays the
safety net: a notification missed while a listener reconnects costs one poll interval.
"""

import datetime as dt

from storage.notify import notification_send

# Outbox rows were committed: the relays publish them.
CHANNEL_OUTBOX = "scheduler_outbox"
# A job's next fire moved earlier, or a run was queued for a retry or a release: the
# schedulers recompute when to wake.
CHANNEL_SCHEDULE = "scheduler_schedule"
# A scheduler replica joined or released its partition leases: the others look again at
# their share (dispatch.partitions) at once.
CHANNEL_PARTITIONS = "scheduler_partitions"


def notify(channel: str, *, at: dt.datetime | None = None) -> None:
    """Wake the listeners of `channel` when the current transaction commits. `at`: the
    instant the new work is due (the payload, ISO 8601), so that a scheduler sleeping
    until an earlier instant goes on sleeping without a query; none: look again."""
    notification_send(channel=channel, payload=notification(channel, at=at)[1])


def notification(channel: str, *, at: dt.datetime | None = None) -> tuple[str, str]:
    """notify's (channel, payload), for a statement that sends it itself
    (storage.rows.rows_insert)."""
    return channel, at.isoformat() if at else ""


def notified_instant(payload: str) -> dt.datetime | None:
    """The instant a notification's payload announces; None when it announces none."""
    try:
        at = dt.datetime.fromisoformat(payload) if payload else None
    except ValueError:
        return None
    return at if at is not None and at.tzinfo is not None else None


# Webhook deliveries were committed: the scheduler's webhook loop posts them.
CHANNEL_WEBHOOKS = "scheduler_webhooks"
