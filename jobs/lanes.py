"""Lanes: the Celery queue a run travels in, from its job's `queue` and the run's kind.

Scheduled runs travel in the job's queue itself; backfill runs in `<queue>.backfill` and
manual triggers in `<queue>.manual`, so a month's backfill (or a burst of triggers) never
sits ahead of the next minute's scheduled runs in one first-in-first-out queue. Workers
that consume a configured queue consume its lanes too (scheduler_project/celery.py), the
relay declares them as it declares the others (quorum where configured), and each lane has
its own high-water mark (docs/semantics.md, "Backpressure, lanes and fair shares").

This is the one place that names lanes: every writer of outbox rows (jobs.outbox,
dispatch.materializer), the settings' queue declarations and reconciliation's view of a
run's queue go through it. It imports no model (the settings import it).
"""

from __future__ import annotations

# Run kind (jobs.models.RunKind's values) -> the suffix of its lane; kinds not named
# here (scheduled) travel in the job's queue.
LANES = {"backfill": "backfill", "manual": "manual"}


def lane_queue(queue: str, kind: str) -> str:
    """The Celery queue of a run of `kind` whose job names `queue`."""
    lane = LANES.get(kind)
    return f"{queue}.{lane}" if lane else queue


def lanes_of(queue: str) -> list[str]:
    """The lane queues of a configured queue (not the queue itself)."""
    return [f"{queue}.{lane}" for lane in LANES.values()]


def lane_queues(queues: list[str]) -> list[str]:
    """Each configured queue followed by its lanes."""
    return [name for queue in queues for name in (queue, *lanes_of(queue))]
