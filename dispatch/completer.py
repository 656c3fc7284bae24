"""The completer: active -> completed for jobs whose schedule is over (a one-time job after
its run, a job past end_at) once none of their runs is active.

On PostgreSQL a job is completed by its last run's own terminal transition: the trigger
`run_ended_completes_job` (jobs/migrations/0017) completes it in the statement that ends
the run, when its schedule is over and no other run of it is active (its row taken SKIP
LOCKED: a trigger or backfill holding it leaves it here). This pass is the safety net (two
runs ending together each seeing the other active, a job past end_at without a run, SQLite
where there is no trigger): it looks at no more than `scan_size` of the jobs awaiting
completion (job_awaiting_completion_idx holds only those), by id from where the previous
pass's window ended, so a pass costs the same however many one-time runs are in flight,
and every job is looked at within ceil(awaiting / scan_size) passes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

from django.db import transaction
from django.db.models import Exists, OuterRef

from jobs.audit import audit_event
from jobs.models import AuditEvent, Job, JobState, Run
from jobs.transitions import ACTIVE_RUN_STATES, jobs_to_completed

from .config import config_require


@dataclasses.dataclass(frozen=True)
class CompleterConfig:
    batch_size: int = 500  # jobs completed per transaction
    scan_size: int = 2000  # jobs awaiting completion looked at per pass

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size", "scan_size"))


@dataclasses.dataclass(frozen=True)
class CompleterResult:
    jobs_completed: int = 0
    batch_full: bool = False


def completer_run_once(*, now: dt.datetime, config: CompleterConfig) -> CompleterResult:
    window = _awaiting_window(config.scan_size)
    if not window:
        return CompleterResult()
    with transaction.atomic():
        completed = _complete_finished_jobs(window, now=now, limit=config.batch_size)
    return CompleterResult(jobs_completed=completed, batch_full=completed >= config.batch_size)


def _awaiting(jobs):
    return jobs.filter(state=JobState.ACTIVE, next_run_at=None, deleted_at=None)


def _finished(jobs):
    # A probe of run_job_active_idx per job: its active runs only, not its history.
    active = Run.objects.filter(job_id=OuterRef("id"), state__in=ACTIVE_RUN_STATES)
    return _awaiting(jobs).exclude(Exists(active))


# Where this process's previous window ended (the completer runs in one thread a process).
_window_end: list[uuid.UUID] = []


def _awaiting_window(size: int) -> list:
    """Up to `size` ids of jobs awaiting completion, by id from where this process's
    previous window ended (wrapping round): each is looked at within
    ceil(awaiting / size) passes."""
    ids = _awaiting(Job.objects.all()).order_by("id").values_list("id", flat=True)
    window = list(ids.filter(id__gt=_window_end[0])[:size]) if _window_end else []
    if len(window) < size:
        window += [job_id for job_id in ids[: size - len(window)] if job_id not in window]
    _window_end[:] = window[-1:]
    return window


def _complete_finished_jobs(window: list, *, now: dt.datetime, limit: int) -> int:
    # Locked, and checked under the lock: a run created meanwhile keeps its job active.
    completed = list(
        _finished(Job.objects.filter(id__in=window))
        .select_for_update(skip_locked=True)
        .values_list("id", flat=True)[:limit]
    )
    if not completed:
        return 0
    jobs_to_completed(job_ids=completed, now=now)
    AuditEvent.objects.bulk_create(
        audit_event(action="job.completed", job_id=job_id) for job_id in completed
    )
    return len(completed)
