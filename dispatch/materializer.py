"""The materializer: turns due occurrences of active jobs into runs.

`materializer_run_once` claims due jobs through `job_due_idx` with FOR UPDATE SKIP LOCKED
and, in one transaction, creates each due occurrence's run, writes its outbox row and
advances `next_run_at`. Any number of replicas may run it at once: a job row is held by one
transaction at a time, and `run_one_per_occurrence` is the backstop.

On the way each occurrence meets the job's policies (jobs.policies; docs/api.md, "Schedule
policies"): misfire (an occurrence later than `grace_seconds` runs or is recorded
`skipped`), overlap (a run still active at the next occurrence), jitter (publication
delayed by a deterministic offset: the run is created `pending`, and the promoter queues
it when due) and pause_after_failures.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db import transaction
from django.db.models import F, Window
from django.db.models.functions import RowNumber

from jobs import keys
from jobs.audit import audit_event
from jobs.models import AuditEvent, Job, JobState, JobVersion, Run, RunKind, RunState
from jobs.outbox import outbox_enqueue_runs
from jobs.policies import misfire_plan, overlap_decision, run_jitter
from jobs.rows import rows_insert
from jobs.schedules import ScheduleError, job_next_fire
from jobs.services import job_pause, jobs_pause_if_failing, run_cancel_request
from jobs.transitions import ACTIVE_RUN_STATES, jobs_advance

from .config import config_require

# Occurrences (run or skipped) one job turns into rows in one pass; a longer backlog goes
# on in the next passes, so an outage of any length costs bounded transactions.
OCCURRENCES_PER_JOB_PER_PASS = 100
# Active scheduled runs of one job the overlap policy loads per pass, newest first: skip
# and buffer_one look at the newest (and whether one is pending), cancel_previous cancels
# them, and an older excess (only after a policy change) is cancelled by the next passes.
OVERLAP_RUNS_PER_JOB = 100


# What a pass reads of a claimed job (decoding the others, labels above all, would cost
# more than the pass's own work on them). Its spec is its current version's, read once.
CLAIMED_JOB_FIELDS = ("state", "version", "next_run_at", "created_at", "resumed_at")


@dataclasses.dataclass(frozen=True)
class MaterializerConfig:
    batch_size: int = 500  # due jobs claimed per transaction

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size",))


@dataclasses.dataclass(frozen=True)
class MaterializerResult:
    runs_created: int = 0  # runs that will execute (queued, or pending on jitter or overlap)
    runs_skipped: int = 0  # occurrences recorded `skipped` (misfire, overlap)
    jobs_paused: int = 0  # by pause_after_failures
    batch_full: bool = False  # as many due jobs as the batch holds: more are probably due


def materializer_run_once(*, now: dt.datetime, config: MaterializerConfig) -> MaterializerResult:
    with transaction.atomic():
        return _materialize_due_jobs(now=now, limit=config.batch_size)


def _due_occurrences(job: Job, now: dt.datetime) -> tuple[list[dt.datetime], dt.datetime | None]:
    """The job's occurrences due by `now` (at most OCCURRENCES_PER_JOB_PER_PASS), and its
    next_run_at after them. Raises ScheduleError."""
    due, at = [], job.next_run_at
    while at is not None and at <= now and len(due) < OCCURRENCES_PER_JOB_PER_PASS:
        due.append(at)
        at = job_next_fire(spec=job.spec, created_at=job.created_at, after=at)
    return due, at


def _claim_due_jobs(*, now: dt.datetime, limit: int) -> list[JobVersion]:
    """The current versions of up to `limit` due active jobs, each with its job (`.job`)
    locked: one statement. Its inner query claims the jobs' ids through `job_due_idx`
    (FOR UPDATE SKIP LOCKED); the outer one reads them with their versions, locking them
    again (already ours) so that it reads each job's latest row. Only ids are sorted, so
    statistics that lag behind a burst cannot make it sort every due job's spec on disk."""
    due = (
        Job.objects.filter(state=JobState.ACTIVE, next_run_at__lte=now)
        .order_by("next_run_at")
        .select_for_update(skip_locked=True)
        .values("id")[:limit]
    )
    versions = list(
        JobVersion.objects.select_related("job")
        .select_for_update(of=("job",))
        .filter(job_id__in=due, version=F("job__version"))
        .only("spec", *(f"job__{field}" for field in CLAIMED_JOB_FIELDS))
    )
    for version in versions:
        version.job.spec = version.spec  # the job's spec is its current version's
    return versions


def _materialize_due_jobs(*, now: dt.datetime, limit: int) -> MaterializerResult:
    versions = {version.job_id: version for version in _claim_due_jobs(now=now, limit=limit)}
    if not versions:
        return MaterializerResult()
    claimed = [version.job for version in versions.values()]
    # Every query a policy needs is one per batch, and only made when a job of the batch
    # has the policy: a batch of one-time jobs without policies costs the claim, one read
    # of existing occurrences and one write each of runs, outbox rows and next_run_at.
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
    existing = _existing_occurrences(plans)
    active = _overlap_runs(jobs)
    runs = []
    for job in jobs:
        due, job.next_run_at = plans[job.id]
        skips = misfire_plan(
            spec=job.spec, created_at=job.created_at, due=due, next_at=job.next_run_at, now=now
        )
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
    _runs_insert(runs)
    outbox_enqueue_runs(runs=[run for run in runs if run.state == RunState.QUEUED], now=now)
    jobs_advance(jobs=jobs)
    if audit:
        AuditEvent.objects.bulk_create(audit)
    skipped = sum(run.state == RunState.SKIPPED for run in runs)
    return MaterializerResult(
        runs_created=len(runs) - skipped,
        runs_skipped=skipped,
        jobs_paused=len(paused),
        batch_full=len(claimed) >= limit,
    )


def _existing_occurrences(plans: dict) -> set[tuple]:
    """(job id, occurrence) of the planned occurrences that already have their run (a
    rewound next_run_at): they are only advanced past."""
    instants = {at for due, _ in plans.values() for at in due}
    if not instants:
        return set()
    return set(
        Run.objects.filter(
            job_id__in=list(plans), kind=RunKind.SCHEDULED, scheduled_for__in=instants
        ).values_list("job_id", "scheduled_for")
    )


def _runs_insert(runs: list[Run]) -> None:
    """The new runs, in one INSERT (jobs.rows: one JSON document unpacked server-side)."""
    rows_insert(runs)


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
    key = keys.occurrence_key(job.id, at)
    # Nothing is due before it was accepted (or resumed): a one-time job dated in the past
    # is due on acceptance, so the discovery lag measures the scheduler, not the date.
    accepted = min(max(job.created_at, job.resumed_at or job.created_at), now)
    due_at = max(at + run_jitter(key, job.spec.get("jitter_seconds") or 0), accepted)
    return Run(
        job=job,
        job_version=version,
        kind=RunKind.SCHEDULED,
        # Held back until its jittered due time: the promoter queues it then.
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
    """Apply the overlap policy's decision to a new run while others of its job are
    active; returns a skip reason, or "" when the run goes ahead."""
    decision = overlap_decision(
        policy=job.spec.get("overlap", "allow"), active=active, scheduled_for=run.scheduled_for
    )
    if decision.outcome == "pending":
        run.state = RunState.PENDING
    for other in decision.cancel:
        if other._state.adding:  # created in this pass, not yet in the database
            _skip(other, decision.cancel_reason, now)
        else:
            run_cancel_request(run=other, actor=None, now=now)
    if decision.cancel:
        active.clear()
    return decision.skip_reason
