"""Shared steps of the fault-injection tests."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth import get_user_model

from jobs.models import Counter, Job
from jobs.services import job_create
from tests.conftest import job_spec


def owner(name: str = "faults"):
    return get_user_model().objects.get_or_create(username=name)[0]


def one_time_job(*, task: str, due_in: float = 0.0, args=(), **overrides) -> Job:
    """A one-time job due `due_in` seconds from now."""
    now = dt.datetime.now(dt.UTC)
    spec = job_spec(
        task=task,
        args=list(args),
        schedule={"kind": "once", "run_at": (now + dt.timedelta(seconds=due_in)).isoformat()},
        **overrides,
    )
    return job_create(owner=owner(), spec=spec, now=now)


def counter(name: str, labels: str = "") -> int:
    return (
        Counter.objects.filter(name=name, labels=labels).values_list("value", flat=True).first()
        or 0
    )
