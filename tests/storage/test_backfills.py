"""storage.backfills: the memory of backfills starts, on upgrade, from the backfill runs
already there, so a range backfilled before it existed is not run again once pruned."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection

from jobs.models import BackfilledOccurrences, Run
from jobs.services import job_backfill
from storage.backfills import BACKFILLED_FROM_RUNS

pytestmark = pytest.mark.django_db

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
HOURLY = {"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"}


def test_the_memory_starts_from_the_backfill_runs_already_there(make_job, user):
    job = make_job(now=NOW, schedule=HOURLY)
    instants = [NOW + dt.timedelta(hours=n) for n in range(3)]
    job_backfill(job=job, instants=instants, actor=user, now=NOW)
    with connection.cursor() as cursor:
        cursor.execute(BACKFILLED_FROM_RUNS.drop)
        cursor.execute(BACKFILLED_FROM_RUNS.create)
    assert sorted(BackfilledOccurrences.objects.values_list("first", "last")) == [
        (at, at) for at in instants
    ]
    Run.objects.filter(job=job).delete()  # as retention does
    again = job_backfill(job=job, instants=instants, actor=user, now=NOW)
    assert (again.created, again.pruned) == ([], instants)
