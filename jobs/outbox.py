"""The one writer of outbox rows, always inside the transaction of the state change that
needs them: the domain's side (a run's lane, its spec's task, redacted errors) of the
statements in storage.outbox.

A row exists only while its message waits to be published: the relay deletes it in the
transaction that saw the broker confirm it (`outbox_delete_published`).
"""

import datetime as dt

from django.db.models import Case, TextField, Value, When
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Concat

from storage.outbox import (
    OutboxEntry,
    outbox_delete_published,
    outbox_discard_pending,
    outbox_enqueue_many,
    outbox_record_failed_try,
)

from .lanes import LANES, REPLAY_LANE, lane_queue
from .models import Run
from .notify import CHANNEL_OUTBOX, notify
from .redaction import redact

# The outbox statements without domain work of their own, for the services that write
# rows (storage.outbox holds them).
__all__ = [
    "outbox_delete_published",
    "outbox_discard_pending",
    "outbox_enqueue_runs",
    "outbox_record_failure",
    "run_lane_queue",
]


def run_lane_queue():
    """The Celery queue of a run (jobs.lanes.lane_queue) as an expression over Run rows:
    its version's `queue`, with the replay lane when it was replayed, else the lane of its
    kind."""
    queue = KeyTextTransform("queue", "job_version__spec")
    text = TextField()
    return Case(
        When(replayed_at__isnull=False,
             then=Concat(queue, Value(f".{REPLAY_LANE}"), output_field=text)),
        *(When(kind=kind, then=Concat(queue, Value(f".{lane}"), output_field=text))
          for kind, lane in LANES.items()),
        default=queue,
        output_field=text,
    )  # fmt: skip


def outbox_enqueue_runs(*, runs: list[Run], now: dt.datetime) -> int:
    """One task message per run (`run.job_version` must be loaded), in one INSERT, to the
    run's lane (jobs.lanes: its kind's, the replay lane once replayed); the relays are
    woken when the transaction commits. Returns the rows written.

    Every run queued again (retry, replay, reconciliation's republication) passes through
    here, and its ActiveRun row goes in the same statement: the run waits in the outbox
    again, and counting it against its owner's limit would hold back its own publication
    (dispatch.shares). The relay counts it again when it publishes it."""
    if not runs:
        return 0
    specs = [run.job_version.spec for run in runs]
    written = outbox_enqueue_many(
        entries=[
            OutboxEntry(run_id=run.id, job_id=run.job_id, task_name=spec["task"],
                        queue=lane_queue(spec["queue"], run.kind,
                                         replayed=run.replayed_at is not None),
                        priority=spec["priority"],
                        timeout_seconds=spec.get("timeout_seconds"))
            for run, spec in zip(runs, specs, strict=True)
        ],
        now=now,
    )  # fmt: skip
    notify(CHANNEL_OUTBOX)
    return written


def outbox_record_failure(
    *, message_ids: list[int], error: BaseException, refused_at: dt.datetime | None = None
) -> int:
    """These rows stay pending for the next try; their tries and last error (redacted) make
    it visible. `refused_at` dates a refusal that lasts (storage.outbox's
    `outbox_record_failed_try`); any other failure clears it."""
    return outbox_record_failed_try(
        message_ids=message_ids, error=redact(repr(error))[:2000], refused_at=refused_at
    )
