"""The promoter: moves runs that wait in PostgreSQL back to `queued` when their time comes,
each with a new outbox row.

- `retry_wait` runs whose `next_attempt_at` has passed (the retry delay lives here, never
  in the broker);
- `pending` runs that are due (their jitter has passed) and, for a buffer_one job, whose
  job has no other run queued, running or waiting for a retry. A paused job's pending runs
  go on too: they were created before the pause, which only stops new occurrences.

Both are the same promotion (claim with FOR UPDATE SKIP LOCKED, `runs_requeue`, outbox),
each in its own transaction, so any number of replicas may run it. Partitioned like the
materializer: a replica given a partition scope promotes only the runs of jobs in the
partitions it holds (the run's own `job_id`, no join), so all of a job's due work goes
through one replica at a time and a replica that lost its leases promotes nothing.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from jobs.models import Run, RunKind, RunState
from jobs.outbox import outbox_enqueue_runs
from jobs.partitions import PartitionScope, in_held_partitions
from jobs.policies import BUSY_RUN_STATES
from jobs.transitions import LIVE_JOB_STATES, runs_requeue

from .config import config_require


@dataclasses.dataclass(frozen=True)
class PromoterConfig:
    batch_size: int = 500  # runs of each kind (retries, pending) promoted per transaction
    scope: PartitionScope | None = None  # as MaterializerConfig.scope

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size",))


@dataclasses.dataclass(frozen=True)
class PromoterResult:
    retries_queued: int = 0  # retry_wait -> queued
    runs_released: int = 0  # pending -> queued
    batch_full: bool = False


def promoter_run_once(*, now: dt.datetime, config: PromoterConfig) -> PromoterResult:
    runs = Run.objects.all()
    if config.scope is not None:
        runs = runs.filter(in_held_partitions(config.scope, job_id="job_id"))
    retries = _promote(
        runs.filter(state=RunState.RETRY_WAIT, next_attempt_at__lte=now),
        order_by="next_attempt_at",
        now=now,
        limit=config.batch_size,
    )
    busy = Run.objects.filter(
        job_id=OuterRef("job_id"), kind=RunKind.SCHEDULED, state__in=BUSY_RUN_STATES
    )
    released = _promote(
        runs.filter(
            state=RunState.PENDING, due_at__lte=now, job__state__in=LIVE_JOB_STATES
        ).exclude(Q(job__spec__overlap="buffer_one") & Exists(busy)),
        order_by="due_at",
        now=now,
        limit=config.batch_size,
    )
    return PromoterResult(
        retries_queued=retries,
        runs_released=released,
        batch_full=max(retries, released) >= config.batch_size,
    )


def _promote(due: QuerySet[Run], *, order_by: str, now: dt.datetime, limit: int) -> int:
    """Claim up to `limit` of the `due` runs, queue them and write their outbox rows, in one
    transaction; returns how many."""
    with transaction.atomic():
        runs = list(
            due.select_for_update(skip_locked=True, of=("self",))
            .select_related("job_version")
            .order_by(order_by)[:limit]
        )
        if not runs:
            return 0
        runs_requeue(run_ids=[run.id for run in runs])
        outbox_enqueue_runs(runs=runs, now=now)
        return len(runs)
