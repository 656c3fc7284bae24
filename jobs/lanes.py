"""Lanes: the Celery queue a run travels in, from its job's `queue`, the run's kind and
whether an operator replayed it.

Scheduled runs travel in the job's queue itself; backfill runs in `<queue>.backfill`,
manual triggers in `<queue>.manual` and replayed runs in `<queue>.replay`, so a month's
backfill, a burst of triggers or a bulk replay of thousands of failed runs never sits ahead
of the next minute's scheduled runs in one first-in-first-out queue. Workers that consume a
configured queue consume its lanes too (scheduler_project/celery.py), the relay declares
them as it declares the others (quorum where configured), and each lane has its own
high-water mark (docs/semantics.md, "Backpressure, lanes and fair shares").

A replayed run (`Run.replayed_at` set) keeps to the replay lane whatever its kind, for its
retries and republications too: a replayed backfill is replay work, not backfill work, and
a run that travels in one lane for good never overtakes or trails its own earlier message
in another.

This is the one place that names lanes: every writer of outbox rows (jobs.outbox,
dispatch.materializer), the settings' queue declarations and reconciliation's view of a
run's queue go through it. It imports no model (the settings import it).
"""

from __future__ import annotations

# Run kind (jobs.models.RunKind's values) -> the suffix of its lane; kinds not named
# here (scheduled) travel in the job's queue.
LANES = {"backfill": "backfill", "manual": "manual"}
# The suffix of the lane of replayed runs, whatever their kind.
REPLAY_LANE = "replay"
# Every lane's suffix, in the order lanes_of lists them.
LANE_SUFFIXES = (*LANES.values(), REPLAY_LANE)


def lane_queue(queue: str, kind: str, *, replayed: bool = False) -> str:
    """The Celery queue of a run of `kind` whose job names `queue` (`replayed`: an
    operator replayed it, `Run.replayed_at` is set)."""
    lane = REPLAY_LANE if replayed else LANES.get(kind)
    return f"{queue}.{lane}" if lane else queue


def lanes_of(queue: str) -> list[str]:
    """The lane queues of a configured queue (not the queue itself)."""
    return [f"{queue}.{lane}" for lane in LANE_SUFFIXES]


def lane_queues(queues: list[str]) -> list[str]:
    """Each configured queue followed by its lanes."""
    return [name for queue in queues for name in (queue, *lanes_of(queue))]
