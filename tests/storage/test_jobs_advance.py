"""storage.jobs against PostgreSQL: the batched advance of jobs' next occurrences."""

from __future__ import annotations

import datetime as dt

import pytest

from jobs.models import Job
from storage.jobs import jobs_advance
from tests.factories import PINNED_NOW

pytestmark = pytest.mark.django_db


def test_jobs_advance_stores_each_job_s_next_occurrence(make_job):
    first, second, untouched = make_job(), make_job(), make_job()
    before = Job.objects.get(id=untouched.id).next_run_at
    later = PINNED_NOW + dt.timedelta(hours=1)

    assert jobs_advance(job_ids=[first.id, second.id], next_run_ats=[later, None]) == 2

    assert Job.objects.get(id=first.id).next_run_at == later
    assert Job.objects.get(id=second.id).next_run_at is None
    assert Job.objects.get(id=untouched.id).next_run_at == before
    assert jobs_advance(job_ids=[], next_run_ats=[]) == 0
