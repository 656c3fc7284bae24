"""The completer: the safety net of job completion (active -> completed for jobs whose
schedule is over, once none of their runs is active).

A job is completed by its last run's own terminal transition: the trigger
`run_ended_completes_job` calls `scheduler_job_complete_if_finished` in the statement that
ends the run (storage.completion, where the rule is written once). This pass calls the same
rule for the jobs the trigger left (two runs ending together each seeing the other active, a
job whose row the trigger found locked, a job past end_at without a run): it looks at no
more than `scan_size` of the jobs awaiting completion (job_awaiting_completion_idx holds
only those), by id from where the previous pass's window ended (`CompleterWindow`, owned by
the scheduler's loop), so a pass costs the same however many one-time runs are in flight,
and every job is looked at within ceil(awaiting / scan_size) passes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

from django.db import transaction
from django.db.models import Exists, OuterRef

from jobs.models import Job, JobState, Run
from jobs.transitions import ACTIVE_RUN_STATES
from storage.completion import jobs_complete_if_finished

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


@dataclasses.dataclass
class CompleterWindow:
    """Where the previous pass's window of jobs awaiting completion ended: the walk's
    cursor, kept by the loop that runs the passes (a fresh one starts from the first)."""

    end: uuid.UUID | None = None

    def advance(self, size: int) -> list[uuid.UUID]:
        """Up to `size` ids of jobs awaiting completion, by id from where the previous
        window ended (wrapping round): each is looked at within ceil(awaiting / size)
        passes."""
        ids = _awaiting(Job.objects.all()).order_by("id").values_list("id", flat=True)
        window = list(ids.filter(id__gt=self.end)[:size]) if self.end is not None else []
        if len(window) < size:
            window += [job_id for job_id in ids[: size - len(window)] if job_id not in window]
        self.end = window[-1] if window else None
        return window


def completer_run_once(
    *, now: dt.datetime, config: CompleterConfig, window: CompleterWindow
) -> CompleterResult:
    ids = window.advance(config.scan_size)
    if not ids:
        return CompleterResult()
    with transaction.atomic():
        # The finished jobs of the window, read without a lock to bound the batch; the rule
        # checks each again under its row lock (a run created meanwhile keeps it active).
        finished = list(
            _finished(Job.objects.filter(id__in=ids)).values_list("id", flat=True)[
                : config.batch_size
            ]
        )
        completed = len(jobs_complete_if_finished(job_ids=finished, now=now))
    return CompleterResult(jobs_completed=completed, batch_full=completed >= config.batch_size)


def _awaiting(jobs):
    # The predicate of job_awaiting_completion_idx: jobs of kind `after` are never over.
    return jobs.filter(state=JobState.ACTIVE, next_run_at=None, deleted_at=None).exclude(
        spec__schedule__kind="after"
    )


def _finished(jobs):
    # A probe of run_job_active_idx per job: its active runs only, not its history.
    active = Run.objects.filter(job_id=OuterRef("id"), state__in=ACTIVE_RUN_STATES)
    return _awaiting(jobs).exclude(Exists(active))
