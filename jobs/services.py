"""Writes on jobs and runs. Views and commands call these; nothing else writes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F, Max, Q

from . import schedules
from .counters import counter_increment
from .models import (
    AttemptState,
    AuditEvent,
    Job,
    JobState,
    JobVersion,
    OutboxMessage,
    OutboxState,
    Run,
    RunKind,
    RunState,
)
from .outbox import outbox_enqueue_runs
from .retry import CAUSE_LOST, CAUSE_TIMEOUT, failure_outcome
from .transitions import (
    ACTIVE_RUN_STATES,
    attempt_fail,
    run_cancel,
    run_replay,
)

# Job states in which its spec may change and operators may act on it.
LIVE_JOB_STATES = (JobState.ACTIVE, JobState.PAUSED)
# A backfill creates at most this many runs; a larger range is refused with 400.
BACKFILL_MAX_RUNS = 1000
# Spec fields whose change moves the next occurrence.
SCHEDULE_FIELDS = ("schedule", "dst", "start_at", "end_at")


def _anchor(spec: dict, created_at: dt.datetime) -> dt.datetime:
    start_at = spec.get("start_at")
    return dt.datetime.fromisoformat(start_at) if start_at else created_at


def job_next_fire(*, spec: dict, created_at: dt.datetime, after: dt.datetime) -> dt.datetime | None:
    """The occurrence after `after`, within start_at/end_at; None when the schedule is over."""
    anchor = _anchor(spec, created_at)
    start_at = spec.get("start_at")
    if start_at and after < anchor:
        after = anchor - dt.timedelta(microseconds=1)
    instant = schedules.next_fire(spec["schedule"], after=after, dst=spec.get("dst"), anchor=anchor)
    return _within_end(spec, instant)


def _within_end(spec: dict, instant: dt.datetime | None) -> dt.datetime | None:
    end_at = spec.get("end_at")
    if instant is not None and end_at and instant > dt.datetime.fromisoformat(end_at):
        return None
    return instant


def job_first_fire(*, spec: dict, now: dt.datetime) -> dt.datetime | None:
    """A new job's first occurrence: at or after now (and start_at, inclusive); a one-time
    job whose run_at has passed fires at once. None when it would never fire."""
    if spec["schedule"]["kind"] == "once":
        return _within_end(spec, schedules.schedule_run_at(spec["schedule"]))
    return job_next_fire(spec=spec, created_at=now, after=now - dt.timedelta(microseconds=1))


def job_create(*, owner: AbstractBaseUser, spec: dict, now: dt.datetime) -> Job:
    """Create a job, its first version and its audit event; `spec` is already validated."""
    first = job_first_fire(spec=spec, now=now)
    with transaction.atomic():
        job = Job.objects.create(
            owner=owner,
            name=spec["name"],
            task=spec["task"],
            spec=spec,
            queue=spec["queue"],
            priority=spec["priority"],
            labels=spec["labels"],
            next_run_at=first,
            created_at=now,
        )
        JobVersion.objects.create(job=job, version=job.version, spec=spec, created_by=owner)
        AuditEvent.objects.create(
            actor=owner,
            actor_label=f"user:{owner.get_username()}",
            action="job.created",
            job=job,
            data={"version": job.version},
        )
    return job


def run_record_duplicate_delivery(*, run_id, worker: str, message_id: str) -> None:
    """A delivery refused because its run was already claimed or finished: make it visible."""
    with transaction.atomic():
        found = Run.objects.filter(id=run_id).update(
            duplicate_deliveries=F("duplicate_deliveries") + 1
        )
        if found:
            AuditEvent.objects.create(
                actor_label=f"system:worker:{worker}"[:200],
                action="run.duplicate_delivery_refused",
                run_id=run_id,
                data={"message_id": message_id},
            )
        counter_increment("scheduler_duplicate_deliveries_total")


def actor_label(user: AbstractBaseUser) -> str:
    return f"user:{user.get_username()}"


def attempt_record_failure(
    *,
    attempt,
    spec: dict,
    retry_base: int,
    cause: str,
    error: str,
    now: dt.datetime,
    by: str,
    only_if: Q | None = None,
) -> str | None:
    """End a running attempt that did not succeed, and retry or fail its run per the policy.

    Returns the run's new state, or None when the attempt no longer held the current token
    (a stale outcome: nothing changed). `by` names the component, for the run's history.
    """
    delay, reason = failure_outcome(
        spec, attempt_number=attempt.number, retry_base=retry_base, cause=cause
    )
    attempt_to = {CAUSE_LOST: AttemptState.LOST, CAUSE_TIMEOUT: AttemptState.TIMED_OUT}.get(
        cause, AttemptState.FAILED
    )
    retry_at = now + dt.timedelta(seconds=delay) if delay is not None else None
    with transaction.atomic():
        won = attempt_fail(
            attempt=attempt,
            now=now,
            error=error,
            retry_at=retry_at,
            reason=reason or "exhausted",
            attempt_to=attempt_to,
            only_if=only_if,
        )
        if not won:
            return None
        if attempt_to != AttemptState.FAILED:
            # A lost or timed-out attempt is not the handler's own report: keep it visible.
            AuditEvent.objects.create(
                actor_label=f"system:{by}"[:200],
                action=f"attempt.{attempt_to}",
                run_id=attempt.run_id,
                data={"attempt": attempt.number, "fencing_token": attempt.fencing_token,
                      "retry_at": retry_at.isoformat() if retry_at else None,
                      "failure_reason": reason},
            )  # fmt: skip
        if attempt_to == AttemptState.LOST:
            counter_increment("scheduler_lease_expired_total")
        if retry_at is None:
            # After the commit, in its own transaction: pausing locks the job row, and doing
            # it here (attempt and run locked) would invert the scheduler's job-then-run order.
            transaction.on_commit(lambda: _pause_job_of_run_if_failing(attempt.run_id, now))
    return "retry_wait" if retry_at else "failed"


def _pause_job_of_run_if_failing(run_id, now: dt.datetime) -> None:
    job = Job.objects.filter(runs__id=run_id).first()
    if job is not None and job.spec.get("pause_after_failures"):
        job_pause_if_failing(job=job, now=now)


def run_cancel_request(*, run: Run, actor: AbstractBaseUser | None, now: dt.datetime) -> bool:
    """Cancel one run; False (nothing changed) when it is already terminal.

    A pending outbox row that no relay holds is deleted, so the message is never sent; one
    a relay is publishing right now is sent, and the worker refuses to claim it.
    """
    with transaction.atomic():
        if not run_cancel(run_id=run.id, now=now):
            return False
        unsent = OutboxMessage.objects.select_for_update(skip_locked=True).filter(
            run_id=run.id, state=OutboxState.PENDING
        )
        OutboxMessage.objects.filter(id__in=[m.id for m in unsent]).delete()
        AuditEvent.objects.create(
            actor=actor,
            actor_label=actor_label(actor) if actor else "system:scheduler",
            action="run.cancelled",
            job_id=run.job_id,
            run=run,
            data={"from_state": run.state},
        )
    return True


def run_replay_request(*, run: Run, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """Queue a failed or cancelled run again: a new attempt of the same run, with the same
    idempotency key and a fresh retry budget. False when the run is in any other state."""
    with transaction.atomic():
        if not run_replay(run_id=run.id):
            return False
        outbox_enqueue_runs(runs=[run], now=now)
        AuditEvent.objects.create(
            actor=actor,
            actor_label=actor_label(actor),
            action="run.replayed",
            job_id=run.job_id,
            run=run,
            data={"from_state": run.state, "failure_reason": run.failure_reason,
                  "attempts_before": run.attempt_count},
        )  # fmt: skip
    return True


def job_cancel(*, job: Job, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """active/paused -> cancelled: no more runs; every run still active is cancelled too.
    False when the job is already cancelled or completed."""
    with transaction.atomic():
        moved = Job.objects.filter(id=job.id, state__in=[JobState.ACTIVE, JobState.PAUSED]).update(
            state=JobState.CANCELLED, next_run_at=None, updated_at=now
        )
        if not moved:
            return False
        AuditEvent.objects.create(
            actor=actor,
            actor_label=actor_label(actor),
            action="job.cancelled",
            job=job,
            data={"from_state": job.state},
        )
        for run in Run.objects.filter(job=job, state__in=ACTIVE_RUN_STATES):
            run_cancel_request(run=run, actor=actor, now=now)
    return True


def _audit(
    *, job: Job, actor: AbstractBaseUser | None, action: str, data: dict, by: str = "scheduler"
):
    return AuditEvent.objects.create(
        actor=actor,
        actor_label=actor_label(actor) if actor else f"system:{by}",
        action=action,
        job=job,
        data=data,
    )


def job_resume_point(
    *, spec: dict, created_at: dt.datetime, now: dt.datetime, since: dt.datetime | None = None
) -> dt.datetime | None:
    """The next occurrence of an edited schedule, on the job's own grid (an interval keeps
    counting from start_at or the job's creation): at or after `since` when given (the
    job's old next_run_at, already due: the occurrences missed since then meet the misfire
    policy rather than vanish), else at or after now."""
    if spec["schedule"]["kind"] == "once":
        return job_first_fire(spec=spec, now=now)
    after = min(since, now) if since is not None else now
    return job_next_fire(
        spec=spec, created_at=created_at, after=after - dt.timedelta(microseconds=1)
    )


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
    with transaction.atomic():
        won = Job.objects.filter(
            id=job.id, version=expected_version, state__in=LIVE_JOB_STATES, deleted_at=None
        ).update(**fields)
        if not won:
            return False
        JobVersion.objects.create(
            job=job, version=expected_version + 1, spec=spec, created_by=actor
        )
        _audit(
            job=job,
            actor=actor,
            action="job.updated",
            data={"version": expected_version + 1, "changed": [c["field"] for c in changed]},
        )
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


def _job_move(*, job: Job, to: str, from_states, only_if: Q | None = None, **fields) -> bool:
    """One conditional UPDATE of a job's state; whether it won."""
    return bool(
        Job.objects.filter(
            only_if or Q(), id=job.id, state__in=list(from_states), deleted_at=None
        ).update(state=to, **fields)
    )


def job_pause(
    *, job: Job, actor: AbstractBaseUser | None, now: dt.datetime, reason: str = ""
) -> bool:
    """active -> paused: no new occurrence is materialized; runs already created go on.
    False when the job is not active."""
    with transaction.atomic():
        if not _job_move(
            job=job, to=JobState.PAUSED, from_states=[JobState.ACTIVE], updated_at=now
        ):
            return False
        _audit(job=job, actor=actor, action="job.paused", data={"reason": reason} if reason else {})
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
    if job.next_run_at is None and job.spec["schedule"]["kind"] != "once":
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
        if not _job_move(
            job=job,
            to=JobState.ACTIVE,
            from_states=[JobState.PAUSED],
            only_if=same_spec,
            updated_at=now,
            resumed_at=now,
            **fields,
        ):
            fresh = Job.objects.filter(id=job.id, state=JobState.PAUSED, deleted_at=None).first()
            if fields and fresh is not None:  # edited meanwhile: again, on the new spec
                return job_resume(job=fresh, actor=actor, now=now)
            return False
        _audit(job=job, actor=actor, action="job.resumed", data={})
    return True


def job_delete(*, job: Job, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """Soft delete: cancel the job (and its active runs) if it is live, then hide it.
    Versions, runs and the audit trail stay. False when it was already deleted."""
    with transaction.atomic():
        job_cancel(job=job, actor=actor, now=now)
        if not Job.objects.filter(id=job.id, deleted_at=None).update(deleted_at=now):
            return False
        _audit(job=job, actor=actor, action="job.deleted", data={})
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
            idempotency_key=f"{job.id}:manual:{uuid.uuid4().hex}",
        )
        outbox_enqueue_runs(runs=[run], now=now)
        AuditEvent.objects.create(
            actor=actor,
            actor_label=actor_label(actor),
            action="job.triggered",
            job=locked,
            run=run,
            data={"version": locked.version},
        )
    return run


class BackfillTooLarge(ValueError):
    """A backfill range holding more occurrences than one request may create."""


def backfill_occurrences(
    *, job: Job, start: dt.datetime, end: dt.datetime, limit: int = BACKFILL_MAX_RUNS
) -> list[dt.datetime]:
    """The job's occurrences in [start, end), by its current schedule and DST policy
    (start_at/end_at do not bound an explicit backfill; an interval's grid extends before
    its anchor). BackfillTooLarge past `limit`; ScheduleError when the schedule cannot be
    evaluated in the range (e.g. at the edge of the calendar)."""
    anchor = _anchor(job.spec, job.created_at)
    try:
        after = start - dt.timedelta(microseconds=1)
        if job.spec["schedule"]["kind"] == "interval" and start < anchor:
            # The same grid, anchor + k * every, counted from a point at or before start.
            every = dt.timedelta(seconds=job.spec["schedule"]["every_seconds"])
            anchor -= -((start - anchor) // every) * every
    except OverflowError as exc:
        raise schedules.ScheduleError("the start is out of the supported range") from exc
    found = []
    for occurrence in schedules.occurrences(
        job.spec["schedule"], after=after, dst=job.spec.get("dst"), anchor=anchor
    ):
        if occurrence.at >= end:
            break
        if len(found) == limit:
            raise BackfillTooLarge(f"the range holds more than {limit} occurrences")
        found.append(occurrence.at)
    return found


def backfill_idempotency_key(job_id, scheduled_for: dt.datetime) -> str:
    return f"{job_id}:backfill:{scheduled_for.astimezone(dt.UTC):%Y%m%dT%H%M%S.%fZ}"


@dataclasses.dataclass(frozen=True)
class BackfillResult:
    created: list[Run]
    existing: list[Run]


def job_backfill(
    *, job: Job, instants: list[dt.datetime], actor: AbstractBaseUser, now: dt.datetime
) -> BackfillResult | None:
    """One `backfill` run per instant, queued now; an instant that already has its backfill
    run keeps it (the job's row lock serializes backfills, `run_one_backfill_per_occurrence`
    is the backstop). None when the job is not live."""
    with transaction.atomic():
        locked = _lock_live_job(job)
        if locked is None:
            return None
        existing = list(
            Run.objects.filter(job=locked, kind=RunKind.BACKFILL, scheduled_for__in=instants)
        )
        have = {run.scheduled_for for run in existing}
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
                idempotency_key=backfill_idempotency_key(job.id, at),
            )
            for at in instants
            if at not in have
        ]
        Run.objects.bulk_create(created)
        outbox_enqueue_runs(runs=created, now=now)
        AuditEvent.objects.create(
            actor=actor,
            actor_label=actor_label(actor),
            action="job.backfilled",
            job=locked,
            data={
                "start": instants[0].isoformat() if instants else None,
                "end": instants[-1].isoformat() if instants else None,
                "created": len(created),
                "existing": len(existing),
            },
        )
    return BackfillResult(created=created, existing=existing)


def job_pause_if_failing(*, job: Job, now: dt.datetime) -> bool:
    """Pause an active job whose last `pause_after_failures` finished runs (since its last
    resume) all failed. Called by the scheduler before it materializes the job's next
    occurrence, and meant to be called where a run becomes failed. Whether it paused."""
    limit = job.spec.get("pause_after_failures")
    if not limit or job.state != JobState.ACTIVE:
        return False
    finished = Run.objects.filter(
        job=job, state__in=[RunState.SUCCEEDED, RunState.FAILED], finished_at__isnull=False
    )
    if job.resumed_at:
        finished = finished.filter(finished_at__gt=job.resumed_at)
    last = list(finished.order_by("-finished_at", "-id").values_list("state", flat=True)[:limit])
    if len(last) < limit or any(state != RunState.FAILED for state in last):
        return False
    return job_pause(job=job, actor=None, now=now, reason=f"{limit} consecutive failed runs")
