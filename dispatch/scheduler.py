"""The scheduler pass: one pass of the scheduler's own concerns, in order.

1. the materializer (dispatch.materializer): due occurrences -> runs, by the job's misfire,
   overlap, jitter and pause_after_failures policies;
2. the promoter (dispatch.promoter): due retries and due, free `pending` runs -> queued;
3. the completer (dispatch.completer): jobs whose schedule is over -> completed.

Each step is a bounded batch in its own transaction(s). `manage.py scheduler` loops this
pass, sleeping until the next due instant (`scheduler_sleep_seconds`); beside it, in loops
of their own, run the reaper, the reconciler and the pruner (idempotency keys, run logs).
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db.models import Min

from jobs.models import Job, JobState, Run, RunState

from .completer import CompleterConfig, CompleterResult, completer_run_once
from .config import config_require
from .materializer import MaterializerConfig, materializer_run_once
from .promoter import PromoterConfig, promoter_run_once


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 500  # due jobs (and due retries) claimed per transaction
    poll_interval: float = 1.0  # longest sleep: picks up jobs created while sleeping

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size",), positive=("poll_interval",))


@dataclasses.dataclass(frozen=True)
class SchedulerResult:
    runs_created: int  # runs that will execute (queued, or pending on jitter or overlap)
    retries_queued: int
    batch_full: bool  # more due work is probably waiting: loop again at once
    runs_skipped: int = 0  # occurrences recorded `skipped` (misfire, overlap)
    runs_released: int = 0  # pending runs queued because they became due and free
    jobs_completed: int = 0
    jobs_paused: int = 0  # by pause_after_failures


def scheduler_run_once(*, now: dt.datetime, config: SchedulerConfig) -> SchedulerResult:
    materialized = materializer_run_once(
        now=now, config=MaterializerConfig(batch_size=config.batch_size)
    )
    promoted = promoter_run_once(now=now, config=PromoterConfig(batch_size=config.batch_size))
    # Completion can wait for a backlog of due work: its query looks at every job whose
    # schedule is over, which a burst of one-time jobs makes thousands while their runs are
    # active, and no run starts sooner for it.
    backlog = materialized.batch_full or promoted.batch_full
    completed = (
        CompleterResult()
        if backlog
        else completer_run_once(now=now, config=CompleterConfig(batch_size=config.batch_size))
    )
    return SchedulerResult(
        runs_created=materialized.runs_created,
        retries_queued=promoted.retries_queued,
        batch_full=materialized.batch_full or promoted.batch_full or completed.batch_full,
        runs_skipped=materialized.runs_skipped,
        runs_released=promoted.runs_released,
        jobs_completed=completed.jobs_completed,
        jobs_paused=materialized.jobs_paused,
    )


def scheduler_next_due(*, now: dt.datetime) -> dt.datetime | None:
    """The earliest instant at which there will be work (the queries use partial indexes).
    Pending runs count only while their jitter is still ahead: a buffered run waits for
    its job's active run, which the poll interval notices."""
    job_due = Job.objects.filter(state=JobState.ACTIVE).aggregate(at=Min("next_run_at"))["at"]
    retry_due = Run.objects.filter(state=RunState.RETRY_WAIT).aggregate(at=Min("next_attempt_at"))[
        "at"
    ]
    jitter_due = Run.objects.filter(state=RunState.PENDING, due_at__gt=now).aggregate(
        at=Min("due_at")
    )["at"]
    candidates = [at for at in (job_due, retry_due, jitter_due) if at is not None]
    return min(candidates) if candidates else None


def scheduler_sleep_seconds(*, now: dt.datetime, config: SchedulerConfig) -> float:
    """Sleep until the next due instant, never longer than the poll interval."""
    next_due = scheduler_next_due(now=now)
    if next_due is None:
        return config.poll_interval
    return min(config.poll_interval, max(0.0, (next_due - now).total_seconds()))
