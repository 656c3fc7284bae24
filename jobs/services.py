"""Writes on jobs and runs. Views and commands call these; nothing else writes."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F

from dispatch.counters import counter_increment

from . import schedules
from .models import AuditEvent, Job, JobVersion, Run


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
