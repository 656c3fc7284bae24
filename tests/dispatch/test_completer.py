"""The completer (dispatch.completer): the safety net of job completion, a function of its
arguments: its walk over the jobs awaiting completion is the `CompleterWindow` its loop
passes in, and it completes by storage.completion's rule (the trigger's)."""

from __future__ import annotations

import datetime as dt

import pytest

from dispatch.completer import CompleterConfig, CompleterWindow, completer_run_once
from dispatch.scheduler import SchedulerConfig, SchedulerWake
from jobs.models import AuditEvent, Job, JobState
from tests.factories import PINNED_NOW, make_job

pytestmark = pytest.mark.django_db

NOW = PINNED_NOW + dt.timedelta(minutes=5)


def awaiting_jobs(user, count: int) -> list:
    """`count` jobs whose schedule is over (no run left), by id."""
    jobs = [make_job(user, now=PINNED_NOW, name=f"job {n}") for n in range(count)]
    Job.objects.filter(id__in=[job.id for job in jobs]).update(next_run_at=None)
    return sorted(job.id for job in jobs)


def test_the_window_walks_the_awaiting_jobs_by_id_and_wraps_round(user):
    ids = awaiting_jobs(user, 5)
    window = CompleterWindow()
    assert [window.advance(2) for _ in range(3)] == [ids[:2], ids[2:4], [ids[4], ids[0]]]
    assert window.advance(2) == ids[1:3]
    # A fresh window starts from the first: two walks never share a cursor.
    assert CompleterWindow().advance(2) == ids[:2]


def test_a_pass_completes_the_finished_jobs_of_its_window_only(user):
    ids = awaiting_jobs(user, 5)
    window, config = CompleterWindow(), CompleterConfig(batch_size=2, scan_size=3)
    first = completer_run_once(now=NOW, config=config, window=window)
    assert (first.jobs_completed, first.batch_full) == (2, True)
    completed = set(Job.objects.filter(state=JobState.COMPLETED).values_list("id", flat=True))
    assert len(completed) == 2 and completed <= set(ids[:3])  # of its window of 3
    # The window walked on from where it ended: the rest within ceil(5 / 3) passes more.
    completer_run_once(now=NOW, config=config, window=window)
    completer_run_once(now=NOW, config=config, window=window)
    assert not Job.objects.filter(state=JobState.ACTIVE).exists()
    assert AuditEvent.objects.filter(action="job.completed").count() == 5
    assert completer_run_once(now=NOW, config=config, window=window).jobs_completed == 0


def test_the_walk_is_where_the_window_says_nothing_else(user):
    ids = awaiting_jobs(user, 5)
    walks = [CompleterWindow(end=ids[1]), CompleterWindow(end=ids[1])]
    assert [w.advance(2) for w in walks] == [ids[2:4], ids[2:4]]
    assert walks[0] == walks[1] == CompleterWindow(end=ids[3])


def test_the_scheduler_loop_owns_the_completers_window():
    wake = SchedulerWake(SchedulerConfig(), listener=None)
    assert wake.completer_window == CompleterWindow()
