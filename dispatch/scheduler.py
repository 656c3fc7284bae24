"""The scheduler: turns due occurrences into runs, and due retries back into queued runs.

`scheduler_run_once` claims due jobs through `job_due_idx` with FOR UPDATE SKIP LOCKED and,
in one transaction, creates each due occurrence's run, writes its outbox row and advances
`next_run_at`. Any number of replicas may run it at once: a job row is held by one
transaction at a time, and `run_one_per_occurrence` is the backstop.

On the way each occurrence meets the job's policies (docs/api.md, "Schedule policies"):
misfire (an occurrence later than `grace_seconds` runs or is recorded `skipped`), overlap
(a run still active at the next occurrence), jitter (publication delayed by a
deterministic offset) and pause_after_failures. Later steps of the same pass release
`pending` runs that are due and free, complete jobs whose schedule is over, and prune
expired idempotency keys.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib

from django.db import transaction
from django.db.models import Exists, F, Min, OuterRef, Q, Window
from django.db.models.functions import RowNumber

from jobs.idempotency import idempotency_prune
from jobs.models import AuditEvent, Job, JobState, JobVersion, Run, RunKind, RunState
from jobs.outbox import outbox_enqueue_runs
from jobs.schedules import ScheduleError
from jobs.services import (
    LIVE_JOB_STATES,
    job_next_fire,
    job_pause,
    job_pause_if_failing,
    run_cancel_request,
)
from jobs.transitions import ACTIVE_RUN_STATES, runs_requeue

# An occurrence later than this (when misfire.grace_seconds is null) is a misfire.
MISFIRE_DEFAULT_GRACE = dt.timedelta(seconds=60)
# The least grace applied: a pass takes milliseconds, so a grace of 0 would skip an
# occurrence reached on time.
MISFIRE_MIN_GRACE = dt.timedelta(seconds=1)
# Occurrences (run or skipped) one job turns into rows in one pass; a longer backlog goes
# on in the next passes, so an outage of any length costs bounded transactions.
OCCURRENCES_PER_JOB_PER_PASS = 100
# Run states that hold a buffer_one job's pending run back.
BUSY_RUN_STATES = (RunState.QUEUED, RunState.RUNNING, RunState.RETRY_WAIT)
# Active scheduled runs of one job the overlap policy loads per pass, newest first: skip
# and buffer_one look at the newest (and whether one is pending), cancel_previous cancels
# them, and an older excess (only after a policy change) is cancelled by the next passes.
OVERLAP_RUNS_PER_JOB = 100


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 500  # due jobs (and due retries) claimed per transaction
    poll_interval: float = 1.0  # longest sleep: picks up jobs created while sleeping


@dataclasses.dataclass(frozen=True)
class SchedulerResult:
    runs_created: int  # runs that will execute (queued, or pending on jitter or overlap)
    retries_queued: int
    batch_full: bool  # more due work is probably waiting: loop again at once
    runs_skipped: int = 0  # occurrences recorded `skipped` (misfire, overlap)
    runs_released: int = 0  # pending runs queued because they became due and free
    jobs_completed: int = 0
    jobs_paused: int = 0  # by pause_after_failures


@dataclasses.dataclass
class _Materialized:
    created: int = 0
    skipped: int = 0
    paused: int = 0
    jobs: int = 0


def occurrence_idempotency_key(job_id, scheduled_for: dt.datetime) -> str:
    return f"{job_id}:{scheduled_for.astimezone(dt.UTC):%Y%m%dT%H%M%S.%fZ}"


def run_jitter(idempotency_key: str, jitter_seconds: int) -> dt.timedelta:
    """A run's publication delay in [0, jitter_seconds], a function of its identity only,
    so every replica and every retry computes the same one."""
    if not jitter_seconds:
        return dt.timedelta(0)
    digest = int.from_bytes(hashlib.sha256(idempotency_key.encode()).digest()[:8], "big")
    return dt.timedelta(seconds=digest % (jitter_seconds + 1))


def scheduler_run_once(*, now: dt.datetime, config: SchedulerConfig) -> SchedulerResult:
    with transaction.atomic():
        materialized = _materialize_due_jobs(now=now, limit=config.batch_size)
    with transaction.atomic():
        requeued = _promote_due_retries(now=now, limit=config.batch_size)
    with transaction.atomic():
        released = _release_pending_runs(now=now, limit=config.batch_size)
    with transaction.atomic():
        completed = _complete_finished_jobs(now=now, limit=config.batch_size)
    idempotency_prune(now=now, limit=config.batch_size)
    return SchedulerResult(
        runs_created=materialized.created,
        retries_queued=requeued,
        batch_full=max(materialized.jobs, requeued, released, completed) >= config.batch_size,
        runs_skipped=materialized.skipped,
        runs_released=released,
        jobs_completed=completed,
        jobs_paused=materialized.paused,
    )


def _due_occurrences(job: Job, now: dt.datetime) -> tuple[list[dt.datetime], dt.datetime | None]:
    """The job's occurrences due by `now` (at most OCCURRENCES_PER_JOB_PER_PASS), and its
    next_run_at after them. Raises ScheduleError."""
    due, at = [], job.next_run_at
    while at is not None and at <= now and len(due) < OCCURRENCES_PER_JOB_PER_PASS:
        due.append(at)
        at = job_next_fire(spec=job.spec, created_at=job.created_at, after=at)
    return due, at


def _misfire_plan(
    job: Job, due: list[dt.datetime], next_at: dt.datetime | None, now: dt.datetime
) -> dict[dt.datetime, str]:
    """Occurrence -> skip reason, for the due occurrences the misfire policy does not run.

    An occurrence is missed when it is later than the grace, counted from the occurrence or
    from the job's creation, whichever is later (a new one-time job whose run_at has passed
    fires as a catch-up).
    """
    misfire = job.spec.get("misfire") or {}
    grace_seconds = misfire.get("grace_seconds")
    grace = MISFIRE_DEFAULT_GRACE if grace_seconds is None else dt.timedelta(seconds=grace_seconds)
    grace = max(grace, MISFIRE_MIN_GRACE)

    def late(at: dt.datetime) -> bool:
        return now - max(at, job.created_at) > grace

    missed = [at for at in due if late(at)]
    policy = misfire.get("policy", "run_all")
    if not missed or policy == "run_all":
        return {}
    if policy == "skip":
        return {
            at: f"misfire: missed by {int((now - at).total_seconds())}s (policy skip)"
            for at in missed
        }
    # run_latest: the latest missed occurrence runs, unless a later due one (in this pass,
    # or waiting beyond this pass's cap) supersedes it.
    superseded = missed
    if len(missed) == len(due) and (next_at is None or next_at > now):
        superseded = missed[:-1]
    return {
        at: "misfire: superseded by a later occurrence (policy run_latest)" for at in superseded
    }


def _materialize_due_jobs(*, now: dt.datetime, limit: int) -> _Materialized:
    jobs = list(
        Job.objects.select_for_update(skip_locked=True)
        .filter(state=JobState.ACTIVE, next_run_at__lte=now)
        .order_by("next_run_at")[:limit]
    )
    result = _Materialized(jobs=len(jobs))
    if not jobs:
        return result
    version_of = Q()
    for job in jobs:
        version_of |= Q(job_id=job.id, version=job.version)
    versions = {v.job_id: v for v in JobVersion.objects.filter(version_of)}
    active = _overlap_runs(jobs)
    runs, audit, advanced = [], [], []
    plans = {}
    for job in jobs:
        if job_pause_if_failing(job=job, now=now):
            result.paused += 1
            continue
        try:
            plans[job.id] = _due_occurrences(job, now)
        except ScheduleError as exc:
            # Validated at creation, so only a changed environment (a zone gone from tzdata,
            # a spec edited by hand) gets here: stop this job visibly rather than fail every
            # batch it is in. Paused, not left to complete: a PATCH of its schedule and a
            # resume bring it back.
            plans[job.id] = ([job.next_run_at], None)
            job_pause(job=job, actor=None, now=now, reason="schedule error")
            audit.append(
                AuditEvent(
                    actor_label="system:scheduler",
                    action="job.schedule_error",
                    job=job,
                    data={"error": str(exc), "after": job.next_run_at.isoformat()},
                )
            )
    # Occurrences that already have their run (a rewound next_run_at) are only advanced.
    existing = set(
        Run.objects.filter(
            job_id__in=list(plans),
            kind=RunKind.SCHEDULED,
            scheduled_for__in=[at for due, _ in plans.values() for at in due],
        ).values_list("job_id", "scheduled_for")
    )
    for job in jobs:
        if job.id not in plans:
            continue
        due, job.next_run_at = plans[job.id]
        advanced.append(job)
        skips = _misfire_plan(job, due, job.next_run_at, now)
        for at in due:
            if (job.id, at) in existing:
                continue
            run = _new_run(job, versions[job.id], at, now)
            reason = skips.get(at) or _apply_overlap(job, run, active.setdefault(job.id, []), now)
            if reason:
                _skip(run, reason, now)
            else:
                active[job.id].append(run)
            runs.append(run)
    Run.objects.bulk_create(runs)
    outbox_enqueue_runs(runs=[run for run in runs if run.state == RunState.QUEUED], now=now)
    Job.objects.bulk_update(advanced, ["next_run_at"])
    AuditEvent.objects.bulk_create(audit)
    result.skipped = sum(run.state == RunState.SKIPPED for run in runs)
    result.created = len(runs) - result.skipped
    return result


def _overlap_runs(jobs: list[Job]) -> dict:
    """Job id -> its active scheduled runs the overlap policy needs, oldest first: none for
    `allow` (not loaded at all), at most OVERLAP_RUNS_PER_JOB, the newest, for the others,
    so a backlog of active runs costs a pass nothing more.

    Overlap is a matter between a job's scheduled runs: manual and backfill runs are
    neither held back by it nor hold scheduled ones back (a backfill of a thousand runs
    must not make cancel_previous cancel them all)."""
    ids = [job.id for job in jobs if job.spec.get("overlap", "allow") != "allow"]
    if not ids:
        return {}
    newest = Window(
        RowNumber(), partition_by=[F("job_id")], order_by=[F("created_at").desc(), F("id").desc()]
    )
    active: dict = {}
    for run in (
        Run.objects.filter(job_id__in=ids, kind=RunKind.SCHEDULED, state__in=ACTIVE_RUN_STATES)
        .annotate(newest=newest)
        .filter(newest__lte=OVERLAP_RUNS_PER_JOB)
        .order_by("created_at", "id")
    ):
        active.setdefault(run.job_id, []).append(run)
    return active


def _new_run(job: Job, version: JobVersion, at: dt.datetime, now: dt.datetime) -> Run:
    key = occurrence_idempotency_key(job.id, at)
    due_at = at + run_jitter(key, job.spec.get("jitter_seconds") or 0)
    return Run(
        job=job,
        job_version=version,
        kind=RunKind.SCHEDULED,
        # Held back until its jittered due time: _release_pending_runs queues it then.
        state=RunState.QUEUED if due_at <= now else RunState.PENDING,
        scheduled_for=at,
        due_at=due_at,
        created_at=now,
        idempotency_key=key,
    )


def _skip(run: Run, reason: str, now: dt.datetime) -> None:
    """A run created skipped: its occurrence stays visible, with why it did not run."""
    run.state, run.skip_reason, run.finished_at = RunState.SKIPPED, reason[:200], now


def _apply_overlap(job: Job, run: Run, active: list[Run], now: dt.datetime) -> str:
    """Apply the overlap policy to a new run while others of its job are active; returns
    a skip reason, or "" when the run goes ahead (pending, for buffer_one)."""
    policy = job.spec.get("overlap", "allow")
    if not active or policy == "allow":
        return ""
    previous = active[-1]
    if policy == "skip":
        return f"overlap: run {previous.id} is still {previous.state} (policy skip)"
    if policy == "buffer_one":
        if any(other.state == RunState.PENDING for other in active):
            return "overlap: a run is already buffered (policy buffer_one)"
        run.state = RunState.PENDING
        return ""
    # cancel_previous: cancel what runs, then go ahead.
    for other in active:
        if other._state.adding:  # created in this pass, not yet in the database
            _skip(
                other,
                f"overlap: superseded by the occurrence at {run.scheduled_for.isoformat()}",
                now,
            )
        else:
            run_cancel_request(run=other, actor=None, now=now)
    active.clear()
    return ""


def _release_pending_runs(*, now: dt.datetime, limit: int) -> int:
    """pending -> queued for runs that are due (their jitter has passed) and, for a
    buffer_one job, whose job has no other run queued, running or waiting for a retry.
    A paused job's pending runs go on too: they were created before the pause, which only
    stops new occurrences."""
    busy = Run.objects.filter(
        job_id=OuterRef("job_id"), kind=RunKind.SCHEDULED, state__in=BUSY_RUN_STATES
    )
    runs = list(
        Run.objects.select_for_update(skip_locked=True, of=("self",))
        .select_related("job_version")
        .filter(state=RunState.PENDING, due_at__lte=now, job__state__in=LIVE_JOB_STATES)
        .exclude(Q(job__spec__overlap="buffer_one") & Exists(busy))
        .order_by("due_at")[:limit]
    )
    if not runs:
        return 0
    runs_requeue(run_ids=[run.id for run in runs])
    outbox_enqueue_runs(runs=runs, now=now)
    return len(runs)


def _complete_finished_jobs(*, now: dt.datetime, limit: int) -> int:
    """active -> completed for jobs whose schedule is over (a one-time job after its run,
    a job past end_at) once none of their runs is active."""
    finished = Job.objects.filter(state=JobState.ACTIVE, next_run_at=None).exclude(
        Exists(Run.objects.filter(job_id=OuterRef("id"), state__in=ACTIVE_RUN_STATES))
    )
    ids = list(finished.values_list("id", flat=True)[:limit])
    if not ids:
        return 0
    completed = list(
        Job.objects.filter(id__in=ids, state=JobState.ACTIVE, next_run_at=None)
        .exclude(Exists(Run.objects.filter(job_id=OuterRef("id"), state__in=ACTIVE_RUN_STATES)))
        .select_for_update(skip_locked=True)
        .values_list("id", flat=True)
    )
    Job.objects.filter(id__in=completed, state=JobState.ACTIVE).update(
        state=JobState.COMPLETED, updated_at=now
    )
    AuditEvent.objects.bulk_create(
        AuditEvent(actor_label="system:scheduler", action="job.completed", job_id=job_id)
        for job_id in completed
    )
    return len(completed)


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
