"""Writes on jobs and runs. Views and commands call these; nothing else writes."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F, Q

from dispatch.counters import counter_increment
from dispatch.models import OutboxMessage, OutboxState
from dispatch.outbox import outbox_enqueue_runs

from . import schedules
from .models import AttemptState, AuditEvent, Job, JobState, JobVersion, Run
from .retry import CAUSE_LOST, CAUSE_TIMEOUT, failure_outcome
from .transitions import (
    ACTIVE_RUN_STATES,
    attempt_fail,
    run_cancel,
    run_replay,
)


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
    return "retry_wait" if retry_at else "failed"


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
