"""The completer: active -> completed for jobs whose schedule is over (a one-time job after
its run, a job past end_at) once none of their runs is active."""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db import transaction
from django.db.models import Exists, OuterRef

from jobs.audit import audit_event
from jobs.models import AuditEvent, Job, JobState, Run
from jobs.transitions import TERMINAL_RUN_STATES, jobs_to_completed

from .config import config_require


@dataclasses.dataclass(frozen=True)
class CompleterConfig:
    batch_size: int = 500  # jobs completed per transaction

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size",))


@dataclasses.dataclass(frozen=True)
class CompleterResult:
    jobs_completed: int = 0
    batch_full: bool = False


def completer_run_once(*, now: dt.datetime, config: CompleterConfig) -> CompleterResult:
    with transaction.atomic():
        completed = _complete_finished_jobs(now=now, limit=config.batch_size)
    return CompleterResult(jobs_completed=completed, batch_full=completed >= config.batch_size)


def _finished(jobs):
    # "Not terminal" rather than "active" (the same runs, by run_state_valid): a probe of a
    # job's runs through their job_id index, which the planner cannot trade for a scan of
    # every active run per job (run_state_idx) when its statistics lag behind a burst.
    active = Run.objects.filter(job_id=OuterRef("id")).exclude(state__in=TERMINAL_RUN_STATES)
    return jobs.filter(state=JobState.ACTIVE, next_run_at=None).exclude(Exists(active))


def _complete_finished_jobs(*, now: dt.datetime, limit: int) -> int:
    ids = list(_finished(Job.objects.all()).values_list("id", flat=True)[:limit])
    if not ids:
        return 0
    # Locked, and checked again under the lock: a run created meanwhile keeps its job active.
    completed = list(
        _finished(Job.objects.filter(id__in=ids))
        .select_for_update(skip_locked=True)
        .values_list("id", flat=True)
    )
    jobs_to_completed(job_ids=completed, now=now)
    AuditEvent.objects.bulk_create(
        audit_event(action="job.completed", job_id=job_id) for job_id in completed
    )
    return len(completed)
