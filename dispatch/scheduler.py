"""The scheduler: turns due occurrences into runs, and due retries back into queued runs.

`scheduler_run_once` claims due jobs through `job_due_idx` with FOR UPDATE SKIP LOCKED and,
in one transaction, creates each occurrence's run, writes its outbox row and advances
`next_run_at`. Any number of replicas may run it at once: a job row is held by one
transaction at a time, and `run_one_per_occurrence` is the backstop.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db import transaction
from django.db.models import Min

from jobs.models import AuditEvent, Job, JobState, JobVersion, Run, RunKind, RunState
from jobs.schedules import ScheduleError
from jobs.services import job_next_fire
from jobs.transitions import runs_requeue

from .outbox import outbox_enqueue_runs


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 500  # due jobs (and due retries) claimed per transaction
    poll_interval: float = 1.0  # longest sleep: picks up jobs created while sleeping


@dataclasses.dataclass(frozen=True)
class SchedulerResult:
    runs_created: int
    retries_queued: int
    batch_full: bool  # more due work is probably waiting: loop again at once


def occurrence_idempotency_key(job_id, scheduled_for: dt.datetime) -> str:
    return f"{job_id}:{scheduled_for.astimezone(dt.UTC):%Y%m%dT%H%M%S.%fZ}"


def scheduler_run_once(*, now: dt.datetime, config: SchedulerConfig) -> SchedulerResult:
    with transaction.atomic():
        created = _materialize_due_jobs(now=now, limit=config.batch_size)
    with transaction.atomic():
        requeued = _promote_due_retries(now=now, limit=config.batch_size)
    return SchedulerResult(
        runs_created=created,
        retries_queued=requeued,
        batch_full=max(created, requeued) >= config.batch_size,
    )


def _materialize_due_jobs(*, now: dt.datetime, limit: int) -> int:
    jobs = list(
        Job.objects.select_for_update(skip_locked=True)
        .filter(state=JobState.ACTIVE, next_run_at__lte=now)
        .order_by("next_run_at")[:limit]
    )
    if not jobs:
        return 0
    versions = {
        (v.job_id, v.version): v
        for v in JobVersion.objects.filter(job_id__in=[job.id for job in jobs])
    }
    # Occurrences that already have their run (a rewound next_run_at) are only advanced.
    existing = set(
        Run.objects.filter(
            job_id__in=[job.id for job in jobs],
            kind=RunKind.SCHEDULED,
            scheduled_for__in=[job.next_run_at for job in jobs],
        ).values_list("job_id", "scheduled_for")
    )
    runs, audit = [], []
    for job in jobs:
        occurrence = job.next_run_at
        if (job.id, occurrence) not in existing:
            runs.append(
                Run(
                    job=job,
                    job_version=versions[(job.id, job.version)],
                    kind=RunKind.SCHEDULED,
                    state=RunState.QUEUED,
                    scheduled_for=occurrence,
                    due_at=occurrence,
                    created_at=now,
                    idempotency_key=occurrence_idempotency_key(job.id, occurrence),
                )
            )
        try:
            job.next_run_at = job_next_fire(
                spec=job.spec, created_at=job.created_at, after=occurrence
            )
        except ScheduleError as exc:
            # Validated at creation, so only a changed environment (a zone gone from tzdata,
            # a spec edited by hand) gets here: stop this job visibly rather than fail every
            # batch it is in.
            job.next_run_at = None
            audit.append(
                AuditEvent(
                    actor_label="system:scheduler",
                    action="job.schedule_error",
                    job=job,
                    data={"error": str(exc), "after": occurrence.isoformat()},
                )
            )
    Run.objects.bulk_create(runs)
    outbox_enqueue_runs(runs=runs, now=now)
    Job.objects.bulk_update(jobs, ["next_run_at"])
    AuditEvent.objects.bulk_create(audit)
    return len(runs)


def _promote_due_retries(*, now: dt.datetime, limit: int) -> int:
    runs = list(
        Run.objects.select_for_update(skip_locked=True, of=("self",))
        .select_related("job_version")
        .filter(state=RunState.RETRY_WAIT, next_attempt_at__lte=now)
        .order_by("next_attempt_at")[:limit]
    )
    if not runs:
        return 0
    runs_requeue(run_ids=[run.id for run in runs])
    outbox_enqueue_runs(runs=runs, now=now)
    return len(runs)


def scheduler_next_due() -> dt.datetime | None:
    """The earliest instant at which there will be work (both queries use partial indexes)."""
    job_due = Job.objects.filter(state=JobState.ACTIVE).aggregate(at=Min("next_run_at"))["at"]
    retry_due = Run.objects.filter(state=RunState.RETRY_WAIT).aggregate(at=Min("next_attempt_at"))[
        "at"
    ]
    candidates = [at for at in (job_due, retry_due) if at is not None]
    return min(candidates) if candidates else None


def scheduler_sleep_seconds(*, now: dt.datetime, config: SchedulerConfig) -> float:
    """Sleep until the next due instant, never longer than the poll interval."""
    next_due = scheduler_next_due()
    if next_due is None:
        return config.poll_interval
    return min(config.poll_interval, max(0.0, (next_due - now).total_seconds()))
