"""Reads on jobs and runs, always scoped to what the user may see."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Prefetch, QuerySet

from .models import Attempt, Job, Run


def _sees_everything(user: AbstractBaseUser) -> bool:
    return bool(user.is_staff or user.groups.filter(name="operators").exists())


def job_list(*, user: AbstractBaseUser, filters: dict | None = None) -> QuerySet[Job]:
    jobs = Job.objects.select_related("owner")
    if not _sees_everything(user):
        jobs = jobs.filter(owner=user)
    filters = filters or {}
    for field in ("state", "task", "queue"):
        if filters.get(field):
            jobs = jobs.filter(**{field: filters[field]})
    return jobs


def job_get(*, user: AbstractBaseUser, job_id) -> Job | None:
    return job_list(user=user).filter(id=job_id).first()


def run_list(*, user: AbstractBaseUser, filters: dict | None = None) -> QuerySet[Run]:
    runs = Run.objects.select_related("job_version").prefetch_related(
        Prefetch("attempts", queryset=Attempt.objects.order_by("number"))
    )
    if not _sees_everything(user):
        runs = runs.filter(job__owner=user)
    filters = filters or {}
    for field in ("job", "state", "kind"):
        if filters.get(field):
            runs = runs.filter(**{field: filters[field]})
    if filters.get("scheduled_after"):
        runs = runs.filter(scheduled_for__gte=filters["scheduled_after"])
    if filters.get("scheduled_before"):
        runs = runs.filter(scheduled_for__lt=filters["scheduled_before"])
    return runs


def run_get(*, user: AbstractBaseUser, run_id) -> Run | None:
    return run_list(user=user).filter(id=run_id).first()
