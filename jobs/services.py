"""Writes on jobs and runs. Views and commands call these; nothing else writes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Max, Q

from storage.jobs import jobs_latest_finished_runs
from storage.rows import rows_insert

from . import keys
from .audit import audit_event, audit_record
from .calendar_services import job_calendars_check, job_calendars_link
from .clock import db_now
from .counters import counter_increment
from .dependencies import dependency_edges_write, is_dependent
from .models import (
    BackfilledOccurrences,
    Job,
    JobState,
    JobVersion,
    Run,
    RunKind,
    RunState,
    WebhookEvent,
)
from .notify import CHANNEL_SCHEDULE, notification, notify
from .outbox import outbox_discard_pending, outbox_enqueue_runs
from .schedules import job_first_fire, job_next_fire, job_resume_point
from .transitions import (
    ACTIVE_RUN_STATES,
    LIVE_JOB_STATES,
    attempt_release,
    job_mark_deleted,
    job_replace_spec,
    job_to_active,
    job_to_cancelled,
    job_to_paused,
    run_cancel,
    run_count_duplicate_delivery,
    run_replay,
    runs_lock_to_cancel,
)
from .webhooks import webhook_event_record

# Spec fields whose change moves the next occurrence.
SCHEDULE_FIELDS = ("schedule", "dst", "start_at", "end_at")


def job_create(*, owner: AbstractBaseUser, spec: dict, now: dt.datetime) -> Job:
    """Create a job, its first version and its audit event; `spec` is already validated.
    The one-job form of `job_create_bulk`, so that every job is written by one path."""
    return job_create_bulk(owner=owner, specs=[spec], now=now, bulk=False)[0]


class JobQuotaExceeded(Exception):
    """The owner would hold more than SCHEDULER_OWNER_MAX_JOBS unfinished jobs."""


# The jobs that count against an owner's quota: those the scheduler still works for.
QUOTA_STATES = (JobState.ACTIVE, JobState.PAUSED)


# A count of an owner's jobs is reused for this long by the process that made it, while
# the owner stays below this share of the limit: far from it, creating a job costs no scan
# of the owner's jobs; near it, every create counts exactly.
QUOTA_RECOUNT_SECONDS = 1.0
QUOTA_RECOUNT_SHARE = 0.9


class QuotaCounts:
    """A process's recent counts of owners' jobs, for job_quota_check: an owner far below
    the limit is counted again only every QUOTA_RECOUNT_SECONDS. Bounded (cleared past
    10,000 owners: a count is only an optimization). One per web process (`QUOTA_COUNTS`);
    a test makes its own."""

    def __init__(self) -> None:
        self.counts: dict[tuple, tuple[int, float]] = {}  # (owner, limit) -> (count, at)

    def reuse(self, *, key: tuple, adding: int, limit: int, now: float) -> bool:
        """Whether the count taken less than a second ago, with `adding` more, is still far
        below the limit (it is then kept with them)."""
        counted = self.counts.get(key)
        if (
            counted is None
            or now - counted[1] >= QUOTA_RECOUNT_SECONDS
            or counted[0] + adding > limit * QUOTA_RECOUNT_SHARE
        ):
            return False
        self.counts[key] = (counted[0] + adding, counted[1])
        return True

    def record(self, *, key: tuple, count: int, now: float) -> None:
        if len(self.counts) > 10_000:
            self.counts.clear()
        self.counts[key] = (count, now)


QUOTA_COUNTS = QuotaCounts()


def job_quota_check(
    *, owner: AbstractBaseUser, adding: int, counts: QuotaCounts = QUOTA_COUNTS
) -> None:
    """JobQuotaExceeded unless the owner's active and paused jobs, with `adding` more, stay
    within SCHEDULER_OWNER_MAX_JOBS. The count stops at the limit (a bounded scan of the
    owner's jobs) and is reused from `counts` for a second while far below it: the limit
    may be overshot by what the owner's other requests create meanwhile (concurrent ones, as
    with any count-then-insert, and those other web processes admit within that second)."""
    limit = settings.SCHEDULER_OWNER_MAX_JOBS
    if not adding:
        return
    key, now = (owner.pk, limit), time.monotonic()
    if counts.reuse(key=key, adding=adding, limit=limit, now=now):
        return
    held = Job.objects.filter(owner=owner, deleted_at=None, state__in=QUOTA_STATES)
    held = held.order_by().values("id")[:limit].count()
    if held + adding > limit:
        raise JobQuotaExceeded(
            f"The owner holds {held} active or paused jobs; {adding} more would pass the limit "
            f"of {limit} (SCHEDULER_OWNER_MAX_JOBS). Delete or cancel jobs first."
        )
    counts.record(key=key, count=held + adding, now=now)


def job_create_bulk(
    *,
    owner: AbstractBaseUser,
    specs: list[dict],
    now: dt.datetime,
    first_fires=None,
    bulk: bool = True,
) -> list[Job]:
    """Create many jobs, each with its first version and its audit event, in one insert
    statement on PostgreSQL (`POST /jobs/bulk/`, and `POST /jobs/` with one spec, `bulk`
    False: then the rows are job_create's); `specs` are already validated, and
    `first_fires` (aligned with them), when given, are their `job_first_fire` at `now`."""
    job_quota_check(owner=owner, adding=len(specs))
    if first_fires is None:
        first_fires = [job_first_fire(spec=spec, now=now) for spec in specs]
    jobs = [
        Job(owner=owner, name=spec["name"], task=spec["task"], spec=spec, queue=spec["queue"],
            priority=spec["priority"], labels=spec["labels"], next_run_at=first, created_at=now)
        for spec, first in zip(specs, first_fires, strict=True)
    ]  # fmt: skip
    naming = [job for job in jobs if job.spec.get("calendars")]
    job_calendars_check(jobs=naming)
    firsts = [job.next_run_at for job in jobs if job.next_run_at is not None]
    with transaction.atomic(savepoint=False):
        # The scheduler's wake-up rides in the insert's statement (delivered on commit).
        rows_insert(groups=[
            jobs,
            [JobVersion(job=job, version=job.version, spec=job.spec, created_by=owner)
             for job in jobs],
            [audit_event(action="job.created", actor=owner, job_id=job.id,
                         data={"version": job.version, **({"bulk": True} if bulk else {})})
             for job in jobs],
        ], notify=notification(CHANNEL_SCHEDULE, at=min(firsts)) if firsts else None)  # fmt: skip
        job_calendars_link(jobs=naming)
        for job in jobs:
            if is_dependent(job.spec):  # a new job: nothing depends on it, so no cycle
                dependency_edges_write(job_id=job.id, spec=job.spec, check_cycle=False)
    return jobs


def run_record_duplicate_delivery(*, run_id, worker: str, message_id: str) -> None:
    """A delivery refused because its run was already claimed or finished: make it visible."""
    with transaction.atomic():
        if run_count_duplicate_delivery(run_id=run_id):
            audit_record(action="run.duplicate_delivery_refused", by=f"worker:{worker}",
                         run_id=run_id, data={"message_id": message_id})  # fmt: skip
        counter_increment("scheduler_duplicate_deliveries_total")


def attempt_release_unstarted(*, attempt, by: str, error: str, only_if: Q | None = None) -> bool:
    """End a reserved attempt that never started, without charging it to the run's budget,
    and queue its run again through the promoter (`jobs.transitions.attempt_release`).
    False when it started, ended or lost its token meanwhile."""
    with transaction.atomic(savepoint=False):
        now = db_now()
        if not attempt_release(attempt=attempt, now=now, error=error, only_if=only_if):
            return False
        audit_record(action="attempt.released", by=by, run_id=attempt.run_id,
                     data={"attempt": attempt.number, "fencing_token": attempt.fencing_token,
                           "reason": error})  # fmt: skip
        notify(CHANNEL_SCHEDULE, at=now)  # the promoter queues it at once
    return True


def run_cancel_request(*, run: Run, actor: AbstractBaseUser | None, now: dt.datetime) -> bool:
    """Cancel one run (its pending outbox rows too); False (nothing changed) when it is
    already terminal."""
    with transaction.atomic():
        if not run_cancel(run_id=run.id, now=now):
            return False
        outbox_discard_pending(run_id=run.id)
        audit_record(action="run.cancelled", actor=actor, job_id=run.job_id, run_id=run.id,
                     data={"from_state": run.state})  # fmt: skip
    return True


def run_replay_request(*, run: Run, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """Queue a failed or cancelled run again: a new attempt of the same run, with the same
    idempotency key and a fresh retry budget. False when the run is in any other state."""
    with transaction.atomic():
        if not run_replay(run_id=run.id):
            return False
        # Its stamp, which sends the message to the replay lane; `run` stays the run as it
        # was before (the audit event says what was replayed).
        run.refresh_from_db(fields=["replayed_at"])
        outbox_enqueue_runs(runs=[run], now=now)
        audit_record(action="run.replayed", actor=actor, job_id=run.job_id, run_id=run.id,
                     data={"from_state": run.state, "failure_reason": run.failure_reason,
                           "attempts_before": run.attempt_count})  # fmt: skip
    return True


def job_cancel(*, job: Job, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """active/paused -> cancelled: no more runs; every run still active is cancelled too.
    False when the job is already cancelled or completed."""
    with transaction.atomic():
        if not job_to_cancelled(job_id=job.id, now=now):
            return False
        audit_record(action="job.cancelled", actor=actor, job_id=job.id,
                     data={"from_state": job.state})  # fmt: skip
        runs = list(Run.objects.filter(job=job, state__in=ACTIVE_RUN_STATES))
        # In the order a packed success locks them (runs_lock_to_cancel).
        runs_lock_to_cancel(run_ids=[run.id for run in runs])
        for run in runs:
            run_cancel_request(run=run, actor=actor, now=now)
    return True


def job_is_editable(*, job: Job) -> bool:
    """Whether the job's spec may change at all (whatever the body): only while it is live."""
    return job.state in LIVE_JOB_STATES and job.deleted_at is None


def job_update(
    *, job: Job, spec: dict, expected_version: int, actor: AbstractBaseUser, now: dt.datetime
) -> bool:
    """Replace a live job's spec (already validated whole) with a new version.

    One conditional UPDATE on (id, version, live state): of two concurrent edits of one
    version, one wins and the other changes nothing and gets False. Runs already created
    keep the version that created them; a schedule change moves next_run_at. A spec equal
    to the stored one changes nothing (no version, no audit): True while the job is live at
    that version.
    """
    changed = spec_diff(job.spec, spec)
    if not changed:
        return Job.objects.filter(
            id=job.id, version=expected_version, state__in=LIVE_JOB_STATES, deleted_at=None
        ).exists()
    fields = {
        "spec": spec,
        "name": spec["name"],
        "task": spec["task"],
        "queue": spec["queue"],
        "priority": spec["priority"],
        "labels": spec["labels"],
        "version": expected_version + 1,
        "updated_at": now,
    }
    if any(job.spec.get(field) != spec.get(field) for field in SCHEDULE_FIELDS):
        fields["next_run_at"] = job_resume_point(
            spec=spec, created_at=job.created_at, now=now, since=job.next_run_at
        )
    relinked = []
    if job.spec.get("calendars") != spec.get("calendars"):
        relinked = [Job(id=job.id, owner_id=job.owner_id, spec=spec)]
        job_calendars_check(jobs=relinked)
    with transaction.atomic():
        if not job_replace_spec(job_id=job.id, expected_version=expected_version, fields=fields):
            return False
        JobVersion.objects.create(
            job=job, version=expected_version + 1, spec=spec, created_by=actor
        )
        if relinked:
            job_calendars_link(jobs=relinked, replace=True)
        if is_dependent(spec) or is_dependent(job.spec):
            # DependencyCycle rolls the whole edit back (a concurrent edit closed one).
            dependency_edges_write(job_id=job.id, spec=spec)
        if fields.get("next_run_at") is not None:
            notify(CHANNEL_SCHEDULE, at=fields["next_run_at"])  # perhaps earlier now
        audit_record(action="job.updated", actor=actor, job_id=job.id,
                     data={"version": expected_version + 1,
                           "changed": [c["field"] for c in changed]})  # fmt: skip
    return True


def spec_diff(before: dict, after: dict) -> list[dict]:
    """Field-level changes between two specs, nested objects by dotted path."""
    changes = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict) and key != "labels":
            changes += [
                {**change, "field": f"{key}.{change['field']}"} for change in spec_diff(old, new)
            ]
        elif old != new:
            changes.append({"field": key, "from": old, "to": new})
    return changes


def job_pause(
    *, job: Job, actor: AbstractBaseUser | None, now: dt.datetime, reason: str = ""
) -> bool:
    """active -> paused: no new occurrence is materialized; runs already created go on.
    False when the job is not active."""
    with transaction.atomic():
        if not job_to_paused(job_id=job.id, now=now):
            return False
        audit_record(action="job.paused", actor=actor, job_id=job.id,
                     data={"reason": reason} if reason else {})  # fmt: skip
    return True


def job_resume(*, job: Job, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """paused -> active. next_run_at was left where the pause found it, so the scheduler's
    next pass applies the job's misfire policy to every occurrence missed meanwhile.

    A recurring job paused by a schedule error has no next_run_at: its schedule is
    evaluated again after its last scheduled run, and ScheduleError (nothing changed) when
    it still cannot be, rather than let the job complete for good. False when the job is
    not paused.
    """
    fields = {}
    if job.next_run_at is None and job.spec["schedule"]["kind"] not in ("once", "after"):
        last = Run.objects.filter(job=job, kind=RunKind.SCHEDULED).aggregate(
            at=Max("scheduled_for")
        )["at"]
        fields["next_run_at"] = job_next_fire(
            spec=job.spec,
            created_at=job.created_at,
            after=last or now - dt.timedelta(microseconds=1),
        )
    # With a recomputed next_run_at, only over the spec it was computed from.
    same_spec = Q(version=job.version, next_run_at=None) if fields else None
    with transaction.atomic():
        if not job_to_active(job_id=job.id, now=now, only_if=same_spec, **fields):
            fresh = Job.objects.filter(id=job.id, state=JobState.PAUSED, deleted_at=None).first()
            if fields and fresh is not None:  # edited meanwhile: again, on the new spec
                return job_resume(job=fresh, actor=actor, now=now)
            return False
        audit_record(action="job.resumed", actor=actor, job_id=job.id)
        notify(CHANNEL_SCHEDULE)  # due again: perhaps at once (missed occurrences)
    return True


def job_delete(*, job: Job, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """Soft delete: cancel the job (and its active runs) if it is live, then hide it.
    Versions, runs and the audit trail stay. False when it was already deleted."""
    with transaction.atomic():
        job_cancel(job=job, actor=actor, now=now)
        if not job_mark_deleted(job_id=job.id, now=now):
            return False
        audit_record(action="job.deleted", actor=actor, job_id=job.id)
    return True


def _current_version(job: Job) -> JobVersion:
    return JobVersion.objects.get(job=job, version=job.version)


def _lock_live_job(job: Job) -> Job | None:
    """The job's row, locked until the caller's transaction ends, if it is still live: a
    concurrent cancel or delete waits for it, or it sees theirs."""
    return (
        Job.objects.select_for_update()
        .filter(id=job.id, state__in=LIVE_JOB_STATES, deleted_at=None)
        .first()
    )


def job_trigger(*, job: Job, actor: AbstractBaseUser, now: dt.datetime) -> Run | None:
    """A manual run now, queued with its outbox row, on the job's current version.

    Allowed on an active or a paused job (an operator asked for it explicitly); overlap and
    misfire policies do not apply to it. None when the job is cancelled, completed or gone.
    """
    with transaction.atomic():
        locked = _lock_live_job(job)
        if locked is None:
            return None
        run = Run.objects.create(
            job=locked,
            job_version=_current_version(locked),
            kind=RunKind.MANUAL,
            state=RunState.QUEUED,
            scheduled_for=now,
            due_at=now,
            created_at=now,
            idempotency_key=keys.manual_key(job.id),
        )
        outbox_enqueue_runs(runs=[run], now=now)
        audit_record(action="job.triggered", actor=actor, job_id=job.id, run_id=run.id,
                     data={"version": locked.version})  # fmt: skip
    return run


NO_STEP = dt.timedelta(0)  # BackfilledOccurrences.step of a single instant


@dataclasses.dataclass(frozen=True)
class BackfillResult:
    created: list[Run]
    existing: list[Run]
    # Instants an earlier backfill ran whose runs retention has deleted since: not again.
    pruned: list[dt.datetime]


def job_backfill(
    *, job: Job, instants: list[dt.datetime], actor: AbstractBaseUser, now: dt.datetime
) -> BackfillResult | None:
    """One `backfill` run per instant, queued now, unless a backfill ran that occurrence
    before: its run kept (`existing`), or deleted by retention since (`pruned`: the job's
    BackfilledOccurrences remember it). The job's row lock serializes backfills,
    `run_one_backfill_per_occurrence` is the backstop. None when the job is not live."""
    with transaction.atomic():
        locked = _lock_live_job(job)
        if locked is None:
            return None
        existing = list(
            Run.objects.filter(job=locked, kind=RunKind.BACKFILL, scheduled_for__in=instants)
        )
        have = {run.scheduled_for for run in existing}
        remembered = _backfilled(job=locked, instants=instants)
        version = _current_version(locked)
        created = [
            Run(
                job=locked,
                job_version=version,
                kind=RunKind.BACKFILL,
                state=RunState.QUEUED,
                scheduled_for=at,
                due_at=now,
                created_at=now,
                idempotency_key=keys.backfill_key(job.id, at),
            )
            for at in instants
            if at not in have and at not in remembered
        ]
        Run.objects.bulk_create(created)
        outbox_enqueue_runs(runs=created, now=now)
        # The runs made now, and those kept from before this memory existed.
        _backfilled_add(job=locked, instants=[at for at in instants if at not in remembered])
        pruned = [at for at in instants if at in remembered and at not in have]
        audit_record(
            action="job.backfilled",
            actor=actor,
            job_id=job.id,
            data={
                "start": instants[0].isoformat() if instants else None,
                "end": instants[-1].isoformat() if instants else None,
                "created": len(created),
                "existing": len(existing),
                "pruned": len(pruned),
            },
        )
    return BackfillResult(created=created, existing=existing, pruned=pruned)


def _backfilled(*, job: Job, instants: list[dt.datetime]) -> set[dt.datetime]:
    """Those of `instants` that the job's BackfilledOccurrences hold."""
    if not instants:
        return set()
    spans = BackfilledOccurrences.objects.filter(
        job=job, last__gte=min(instants), first__lte=max(instants)
    ).values_list("first", "last", "step")
    return {
        at
        for at in instants
        for first, last, step in spans
        if first <= at <= last and (at == first or (step and (at - first) % step == NO_STEP))
    }


def _backfilled_add(*, job: Job, instants: list[dt.datetime]) -> None:
    """Remember `instants` as backfilled: each run of evenly spaced ones in one row."""
    spans: list[list] = []  # [first, last, step]
    for at in sorted(set(instants)):
        if spans and (spans[-1][2] == NO_STEP or at - spans[-1][1] == spans[-1][2]):
            spans[-1][1:] = [at, at - spans[-1][1]]
        else:
            spans.append([at, at, NO_STEP])
    BackfilledOccurrences.objects.bulk_create(
        BackfilledOccurrences(job=job, first=first, last=last, step=step)
        for first, last, step in spans
    )


def job_pause_if_failing(*, job: Job, now: dt.datetime) -> bool:
    """Pause an active job whose last `pause_after_failures` finished runs (since its last
    resume) all failed; called where a run becomes failed. Whether it paused."""
    return bool(jobs_pause_if_failing(jobs=[job], now=now))


def jobs_pause_if_failing(*, jobs: list[Job], now: dt.datetime) -> set:
    """`job_pause_if_failing` for many jobs, with one query for the whole batch (none when
    no job has the policy); the scheduler calls it before it materializes their next
    occurrences. The ids of the jobs it paused."""
    limits = {
        job.id: job.spec["pause_after_failures"]
        for job in jobs
        if job.spec.get("pause_after_failures") and job.state == JobState.ACTIVE
    }
    if not limits:
        return set()
    failed, other = _latest_finished_runs(limits)
    paused = set()
    for job in jobs:
        limit = limits.get(job.id)
        if limit and failed[job.id] == limit and job.id not in other:
            reason = f"{limit} consecutive failed runs"
            with transaction.atomic():  # the pause and its webhooks' deliveries, or neither
                if job_pause(job=job, actor=None, now=now, reason=reason):
                    webhook_event_record(
                        event=WebhookEvent.JOB_PAUSED_AFTER_FAILURES, job_id=job.id, now=now
                    )
                    paused.add(job.id)
    return paused


def _latest_finished_runs(limits: dict) -> tuple[dict, set]:
    """(job id -> failed runs among its latest `limits[job]` finished ones, the jobs of
    which one of those succeeded)."""
    failed, other = dict.fromkeys(limits, 0), set()
    for job_id, state in jobs_latest_finished_runs(limits=limits):
        if state == RunState.FAILED:
            failed[job_id] += 1
        else:
            other.add(job_id)
    return failed, other
