"""Writes and reads of calendars: versioned and audited as jobs are, and the index of the
jobs that name them (JobCalendar), through which an edit reaches exactly those jobs."""

from __future__ import annotations

import datetime as dt
import uuid

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import QuerySet

from .audit import audit_event, audit_record
from .calendars import ROLES, CalendarRefused, CalendarView
from .models import AuditEvent, Calendar, CalendarVersion, Job, JobCalendar
from .notify import CHANNEL_SCHEDULE, notify
from .roles import user_is_operator
from .schedules import job_resume_point
from .transitions import LIVE_JOB_STATES


def calendar_list(*, user: AbstractBaseUser) -> QuerySet[Calendar]:
    calendars = Calendar.objects.select_related("owner").filter(deleted_at=None)
    if not user_is_operator(user):
        calendars = calendars.filter(owner=user)
    return calendars


def calendar_get(*, user: AbstractBaseUser, calendar_id) -> Calendar | None:
    return calendar_list(user=user).filter(id=calendar_id).first()


def calendar_jobs(*, calendar: Calendar) -> QuerySet[Job]:
    """The live jobs whose current version names `calendar`, through its index."""
    return Job.objects.filter(
        id__in=JobCalendar.objects.filter(calendar=calendar).values("job_id"), deleted_at=None
    ).order_by("name")


def calendar_create(
    *, owner: AbstractBaseUser, name: str, spec: dict, now: dt.datetime
) -> Calendar:
    """A calendar, its first version and its audit event; `spec` is already validated."""
    with transaction.atomic():
        calendar = Calendar.objects.create(owner=owner, name=name, spec=spec, created_at=now)
        CalendarVersion.objects.create(calendar=calendar, version=1, spec=spec, created_by=owner)
        audit_record(action="calendar.created", actor=owner,
                     data={"calendar": str(calendar.id), "version": 1})  # fmt: skip
    return calendar


def calendar_update(
    *,
    calendar: Calendar,
    name: str,
    spec: dict,
    expected_version: int,
    actor: AbstractBaseUser,
    now: dt.datetime,
) -> bool:
    """A new version of the calendar (compare-and-set on `expected_version`: of two
    concurrent edits one wins, the other gets False), and, in the same transaction, the
    jobs that name it (found through job_calendar_by_calendar_idx, locked, nothing else
    read) re-evaluated: each one's next_run_at is computed again from where it stood, and
    each gets an audit event. Runs already created keep the decision they were made with."""
    version = expected_version + 1
    with transaction.atomic():
        won = Calendar.objects.filter(
            id=calendar.id, version=expected_version, deleted_at=None
        ).update(name=name, spec=spec, version=version, updated_at=now)
        if not won:
            return False
        CalendarVersion.objects.create(
            calendar=calendar, version=version, spec=spec, created_by=actor
        )
        audit_record(action="calendar.updated", actor=actor,
                     data={"calendar": str(calendar.id), "version": version})  # fmt: skip
        moved = calendar_jobs_reschedule(calendar_id=calendar.id, actor=actor, now=now)
        if moved:
            notify(CHANNEL_SCHEDULE, at=min(moved))
    return True


def calendar_jobs_reschedule(
    *, calendar_id, actor: AbstractBaseUser | None, now: dt.datetime
) -> list[dt.datetime]:
    """Move the next due time of exactly the live jobs naming the calendar (locked FOR
    UPDATE in id order, through the link index); their next_run_at instants after."""
    jobs = list(
        Job.objects.select_for_update()
        .filter(
            id__in=JobCalendar.objects.filter(calendar_id=calendar_id).values("job_id"),
            state__in=LIVE_JOB_STATES,
            deleted_at=None,
        )
        .exclude(next_run_at=None)
        .order_by("id")
    )
    moved, events = [], []
    for job in jobs:
        at = job_resume_point(spec=job.spec, created_at=job.created_at, now=now,
                              since=job.next_run_at)  # fmt: skip
        Job.objects.filter(id=job.id, version=job.version).update(next_run_at=at, updated_at=now)
        events.append(audit_event(action="job.calendar_changed", actor=actor, job_id=job.id,
                                  data={"calendar": str(calendar_id)}))  # fmt: skip
        if at is not None:
            moved.append(at)
    AuditEvent.objects.bulk_create(events)
    return moved


def calendar_delete(*, calendar: Calendar, actor: AbstractBaseUser, now: dt.datetime) -> bool:
    """Soft delete; refused (False) while a live job names it, so no job is left naming a
    calendar that vanished."""
    with transaction.atomic():
        if calendar_jobs(calendar=calendar).filter(state__in=LIVE_JOB_STATES).exists():
            return False
        if not Calendar.objects.filter(id=calendar.id, deleted_at=None).update(deleted_at=now):
            return False
        audit_record(action="calendar.deleted", actor=actor, data={"calendar": str(calendar.id)})
    return True


def job_calendar_ids(spec: dict) -> dict[str, list[str]]:
    named = spec.get("calendars") or {}
    return {role: [str(value) for value in named.get(role) or ()] for role in ROLES}


def job_calendars_check(*, jobs: list[Job]) -> None:
    """CalendarRefused when a job names a calendar that is not its owner's live calendar
    (the same words whether it exists or not). Call before writing anything."""
    for refusal in job_calendar_refusals(owned=[(job.owner_id, job.spec) for job in jobs]):
        if refusal:
            raise CalendarRefused(refusal)


def job_calendar_refusals(*, owned: list[tuple[int, dict | None]]) -> list[str]:
    """For each (owner id, job spec): why its calendars are refused, or "" (one query for
    all of them)."""
    named = [
        {calendar_id for ids in job_calendar_ids(spec or {}).values() for calendar_id in ids}
        for _, spec in owned
    ]
    every = {uuid.UUID(calendar_id) for ids in named for calendar_id in ids}
    found = set()
    if every:
        found = {
            (str(calendar_id), owner_id)
            for calendar_id, owner_id in Calendar.objects.filter(
                id__in=every, deleted_at=None
            ).values_list("id", "owner_id")
        }
    refusals = []
    for (owner_id, _), ids in zip(owned, named, strict=True):
        missing = sorted(i for i in ids if (i, owner_id) not in found)
        refusals.append(f"calendar {missing[0]} is not one of yours" if missing else "")
    return refusals


def job_calendars_link(*, jobs: list[Job], replace: bool = False) -> None:
    """Write the links of each job's current spec to the calendars it names (replacing
    the old ones with `replace`), checked first by job_calendars_check. Call inside the
    transaction that writes the jobs."""
    links = [
        JobCalendar(job_id=job.id, calendar_id=calendar_id, role=role)
        for job in jobs
        for role, ids in job_calendar_ids(job.spec).items()
        for calendar_id in ids
    ]
    if replace:
        JobCalendar.objects.filter(job_id__in=[job.id for job in jobs]).delete()
    JobCalendar.objects.bulk_create(links, ignore_conflicts=True)


def calendar_views(*, ids) -> dict[str, CalendarView]:
    """The current calendars of `ids` as decisions read them (one query; deleted ones are
    left out, and a job naming one decides as if it did not)."""
    if not ids:
        return {}
    return {
        str(row.id): CalendarView(id=str(row.id), name=row.name, spec=row.spec)
        for row in Calendar.objects.filter(id__in=set(ids), deleted_at=None).only(
            "id", "name", "spec"
        )
    }
