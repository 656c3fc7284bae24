"""The materializer: turns due occurrences of active jobs into runs.

`materializer_run_once` claims due jobs through `job_due_idx` with FOR UPDATE SKIP LOCKED
and, in one transaction, creates each due occurrence's run, writes its outbox row and
advances `next_run_at`. A replica given a partition scope claims only the jobs of the
partitions whose lease it holds (jobs.partitions, checked in the claim's own statement).
Any number of replicas may run it at once: a job row is held by one transaction at a time,
and `run_one_per_occurrence` is the backstop.

On the way each occurrence meets the job's policies (jobs.policies; docs/api.md, "Schedule
policies"): misfire (an occurrence later than `grace_seconds` runs or is recorded
`skipped`), overlap (a run still active at the next occurrence), jitter (publication
delayed by a deterministic offset: the run is created `pending`, and the promoter queues
it when due) and pause_after_failures.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import uuid

from django.db import transaction
from django.db.models import F, Window
from django.db.models.functions import RowNumber

from jobs import keys
from jobs.audit import audit_event
from jobs.calendar_services import calendar_views, job_calendar_ids
from jobs.lanes import lane_queue
from jobs.models import AuditEvent, Run, RunKind, RunState
from jobs.notify import CHANNEL_OUTBOX, notify
from jobs.occurrences import JobCalendars, job_paused_reason, occurrence_decide
from jobs.partitions import PartitionScope
from jobs.policies import misfire_plan, overlap_decision, run_jitter
from jobs.schedules import ScheduleError, job_next_fire
from jobs.services import job_pause, jobs_pause_if_failing, run_cancel_request
from jobs.transitions import ACTIVE_RUN_STATES, runs_lock_to_cancel
from storage.schedule import (
    DueJob,
    JobAdvance,
    ScheduledRun,
    jobs_due_claim,
    runs_write_scheduled,
)

from .config import config_require
from .failpoints import failpoint

# Occurrences (run or skipped) one job turns into rows in one pass; a longer backlog goes
# on in the next passes, so an outage of any length costs bounded transactions.
OCCURRENCES_PER_JOB_PER_PASS = 100
# Active scheduled runs of one job the overlap policy loads per pass, newest first: skip
# and buffer_one look at the newest (and whether one is pending), cancel_previous cancels
# them, and an older excess (only after a policy change) is cancelled by the next passes.
OVERLAP_RUNS_PER_JOB = 100


@dataclasses.dataclass(slots=True)
class NewRun:
    """A run this pass creates: the columns it sets; every other takes its default."""

    id: uuid.UUID
    job: DueJob
    state: str
    scheduled_for: dt.datetime
    due_at: dt.datetime
    idempotency_key: str
    skip_reason: str = ""
    finished_at: dt.datetime | None = None


@dataclasses.dataclass(frozen=True)
class MaterializerConfig:
    batch_size: int = 500  # due jobs claimed per transaction
    # Only the jobs of the partitions this replica holds (dispatch.partitions); None: every
    # job (tests of one replica).
    scope: PartitionScope | None = None

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size",))


@dataclasses.dataclass(frozen=True)
class MaterializerResult:
    runs_created: int = 0  # runs that will execute (queued, or pending on jitter or overlap)
    runs_skipped: int = 0  # occurrences recorded `skipped` (calendar, misfire, overlap)
    jobs_paused: int = 0  # by pause_after_failures
    batch_full: bool = False  # as many due jobs as the batch holds: more are probably due


def materializer_run_once(*, now: dt.datetime, config: MaterializerConfig) -> MaterializerResult:
    with transaction.atomic():
        return _materialize_due_jobs(now=now, limit=config.batch_size, scope=config.scope)


def _due_occurrences(job: DueJob, now: dt.datetime) -> tuple[list[dt.datetime], dt.datetime | None]:
    """The job's occurrences due by `now` (at most OCCURRENCES_PER_JOB_PER_PASS), and its
    next_run_at after them. Raises ScheduleError."""
    due, at = [], job.next_run_at
    while at is not None and at <= now and len(due) < OCCURRENCES_PER_JOB_PER_PASS:
        due.append(at)
        at = job_next_fire(spec=job.spec, created_at=job.created_at, after=at)
    return due, at


def _claim_due_jobs(
    *, now: dt.datetime, limit: int, scope: PartitionScope | None = None
) -> list[DueJob]:
    """Up to `limit` due active jobs, their rows locked (storage.schedule.jobs_due_claim):
    of the partitions `scope`'s holder holds at that statement, with a scope."""
    holder, partitions = (scope.holder, scope.partitions) if scope is not None else (None, 0)
    return jobs_due_claim(now=now, limit=limit, holder=holder, partitions=partitions)


def _materialize_due_jobs(
    *, now: dt.datetime, limit: int, scope: PartitionScope | None
) -> MaterializerResult:
    claimed = _claim_due_jobs(now=now, limit=limit, scope=scope)
    if not claimed:
        return MaterializerResult()
    failpoint("materializer.after_claim")  # the claimed jobs locked, nothing written yet
    # Every query a policy needs is one per batch, and only made when a job of the batch
    # has the policy: a batch of one-time jobs without policies costs the claim and one
    # statement that writes the runs, their outbox rows and the jobs' next_run_at.
    paused = jobs_pause_if_failing(jobs=claimed, now=now)
    jobs = [job for job in claimed if job.id not in paused]
    audit, plans = [], {}
    for job in jobs:
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
                audit_event(action="job.schedule_error", job_id=job.id,
                            data={"error": str(exc), "after": job.next_run_at.isoformat()})
            )  # fmt: skip
    existing = _existing_occurrences(plans, jobs)
    active = _overlap_runs(jobs)
    # cancel_previous cancels the active runs of several jobs in this transaction: locked
    # first, in the order a packed success locks them (runs_lock_to_cancel).
    runs_lock_to_cancel(
        run_ids=[
            run.id
            for job in jobs
            if job.spec.get("overlap") == "cancel_previous"
            for run in active.get(job.id, ())
        ]
    )
    runs = []
    views = calendar_views(
        ids=[i for job in jobs for ids in job_calendar_ids(job.spec).values() for i in ids]
    )
    for job in jobs:
        due, job.next_run_at = plans[job.id]
        skips = misfire_plan(
            spec=job.spec, created_at=job.created_at, due=due, next_at=job.next_run_at, now=now
        )
        calendars = JobCalendars.of(job.spec, views)
        for at in due:
            if (job.id, at) in existing:
                continue
            run = _new_run(job, at, now)
            reason = occurrence_decide(
                at=at,
                calendars=calendars,
                paused=_missed_while_paused(job, at, skips),
                misfire=skips.get(at, ""),
                # Called at once, and only when nothing else skips it (it acts on runs).
                overlap=functools.partial(
                    _apply_overlap, job, run, active.setdefault(job.id, []), now
                ),
            ).skip_reason
            if reason:
                _skip(run, reason, now)
            else:
                active[job.id].append(run)
            runs.append(run)
    created, skipped = _runs_write(runs, jobs, now)
    if audit:
        AuditEvent.objects.bulk_create(audit)
    return MaterializerResult(
        runs_created=created,
        runs_skipped=skipped,
        jobs_paused=len(paused),
        batch_full=len(claimed) >= limit,
    )


def _missed_while_paused(job: DueJob, at: dt.datetime, skips: dict) -> str:
    """The `paused:` reason of a due occurrence the misfire policy skips because the job
    was paused when it fell due (resumed since), else ""."""
    if at in skips and job.resumed_at is not None and at < job.resumed_at:
        return job_paused_reason(spec=job.spec)[0]
    return ""


def _existing_occurrences(plans: dict, jobs: list[DueJob]) -> set[tuple]:
    """(job id, occurrence) of the planned occurrences that already have their run (a
    rewound next_run_at): they are only advanced past. The runs' INSERT passes over them
    itself (ON CONFLICT DO NOTHING), so only the jobs whose overlap policy must not count
    them as new runs are looked up."""
    ids = {job.id for job in jobs if job.spec.get("overlap", "allow") != "allow"}
    plans = {job_id: plan for job_id, plan in plans.items() if job_id in ids}
    instants = {at for due, _ in plans.values() for at in due}
    if not instants:
        return set()
    return set(
        Run.objects.filter(
            job_id__in=list(plans), kind=RunKind.SCHEDULED, scheduled_for__in=instants
        ).values_list("job_id", "scheduled_for")
    )


def _runs_write(runs: list[NewRun], jobs: list[DueJob], now: dt.datetime) -> tuple[int, int]:
    """Write the new runs, the outbox rows of those queued and the jobs' advanced
    next_run_at in one statement (storage.schedule.runs_write_scheduled); (runs created to
    execute, runs created skipped). The relays are woken at commit."""
    written = runs_write_scheduled(
        runs=[
            ScheduledRun(
                id=run.id, job_id=run.job.id, job_version_id=run.job.version_id,
                owner_id=run.job.owner_id, state=run.state, scheduled_for=run.scheduled_for,
                due_at=run.due_at, idempotency_key=run.idempotency_key,
                skip_reason=run.skip_reason, finished_at=run.finished_at,
                task_name=run.job.spec["task"],
                queue=lane_queue(run.job.spec["queue"], RunKind.SCHEDULED),
                priority=run.job.spec["priority"],
                timeout_seconds=run.job.spec.get("timeout_seconds"),
            )
            for run in runs
        ],
        jobs=[JobAdvance(job_id=job.id, next_run_at=job.next_run_at) for job in jobs],
        now=now,
    )  # fmt: skip
    if written.outboxed:
        notify(CHANNEL_OUTBOX)
    return written.created, written.skipped


def _overlap_runs(jobs: list[DueJob]) -> dict:
    """Job id -> its active scheduled runs the overlap policy needs, oldest first: none for
    `allow` (not loaded at all), at most OVERLAP_RUNS_PER_JOB, the newest, for the others,
    so a backlog of active runs costs a pass nothing more.

    Overlap is a matter between a job's scheduled runs: manual and backfill runs are
    neither held back by it nor hold scheduled ones back (a backfill of a thousand runs
    must not make cancel_previous cancel them all)."""
    ids = [job.id for job in jobs if job.spec.get("overlap", "allow") != "allow"]
    if not ids:
        return {}
    active: dict = {}
    for run in active_scheduled_runs(ids):
        active.setdefault(run.job_id, []).append(run)
    return active


def active_scheduled_runs(job_ids: list):
    """The newest OVERLAP_RUNS_PER_JOB active scheduled runs of each job, oldest first:
    read through run_job_active_idx (active runs only), never a job's history."""
    newest = Window(
        RowNumber(), partition_by=[F("job_id")], order_by=[F("created_at").desc(), F("id").desc()]
    )
    return (
        Run.objects.filter(job_id__in=job_ids, kind=RunKind.SCHEDULED, state__in=ACTIVE_RUN_STATES)
        .annotate(newest=newest)
        .filter(newest__lte=OVERLAP_RUNS_PER_JOB)
        .order_by("created_at", "id")
    )


def _new_run(job: DueJob, at: dt.datetime, now: dt.datetime) -> NewRun:
    key = keys.occurrence_key(job.id, at)
    # Nothing is due before it was accepted (or resumed): a one-time job dated in the past
    # is due on acceptance, so the discovery lag measures the scheduler, not the date.
    accepted = min(max(job.created_at, job.resumed_at or job.created_at), now)
    due_at = max(at + run_jitter(key, job.spec.get("jitter_seconds") or 0), accepted)
    return NewRun(
        id=uuid.uuid4(),
        job=job,
        # Held back until its jittered due time: the promoter queues it then.
        state=RunState.QUEUED if due_at <= now else RunState.PENDING,
        scheduled_for=at,
        due_at=due_at,
        idempotency_key=key,
    )


def _skip(run: NewRun, reason: str, now: dt.datetime) -> None:
    """A run created skipped: its occurrence stays visible, with why it did not run."""
    run.state, run.skip_reason, run.finished_at = RunState.SKIPPED, reason[:200], now


def _apply_overlap(job: DueJob, run: NewRun, active: list, now: dt.datetime) -> str:
    """Apply the overlap policy's decision to a new run while others of its job are
    active; returns a skip reason, or "" when the run goes ahead."""
    decision = overlap_decision(
        policy=job.spec.get("overlap", "allow"), active=active, scheduled_for=run.scheduled_for
    )
    if decision.outcome == "pending":
        run.state = RunState.PENDING
    for other in decision.cancel:
        if isinstance(other, NewRun):  # created in this pass, not yet in the database
            _skip(other, decision.cancel_reason, now)
        else:
            run_cancel_request(run=other, actor=None, now=now)
    if decision.cancel:
        active.clear()
    return decision.skip_reason
