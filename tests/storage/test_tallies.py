"""storage.tallies: the triggers that keep the metrics' tallies, as their Ddl values install
and remove them, against PostgreSQL: a released attempt is told by its column, and each
Ddl's create starts its tallies from the rows already there."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import connection
from django.db.models import Sum

from dispatch.reaper import ReaperConfig, reaper_run_once
from jobs.clock import db_now
from jobs.models import Attempt, AttemptState, Run, Tally
from jobs.transitions import RELEASED_ERROR, attempt_fail, runs_reserve
from storage.tallies import (
    ATTEMPTS,
    DEAD_LETTER_TALLY,
    DEAD_LETTERS,
    DEAD_LETTERS_PRUNED,
    OUTBOX_BACKLOG,
    RUNS_BY_STATE,
    STAGE_HISTOGRAMS,
    STATE_TALLIES,
    STATE_TALLY_TRIGGERS,
)
from tests.factories import PINNED_NOW, claim

pytestmark = pytest.mark.django_db

HISTOGRAM_TRIGGERS = ("run_measure_insert", "run_measure_update", "attempt_measure_finish")


def tally(name: str, labels: str = "") -> int:
    rows = Tally.objects.filter(name=name, labels=labels)
    return rows.aggregate(n=Sum("count"))["n"] or 0


def attempts(outcome: str) -> int:
    return tally(ATTEMPTS, f'outcome="{outcome}"')


def installed(names) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgname = ANY(%s)", [list(names)])
        return cursor.fetchone()[0]


def run_script(script: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(script)


def test_a_released_attempt_is_not_counted_and_a_lost_one_is(queued_run):
    """A pack's reserved attempts, its worker lost: the reaper charges the first (timed
    out past its deadline, counted) and releases the other (lost and `released`, not
    counted), whatever its error says."""
    runs = [queued_run(retry={"max_attempts": 3}) for _ in range(2)]
    reserved = runs_reserve(run_ids=[run.id for run in runs], worker="w", claim_id=uuid.uuid4())
    assert not any(Attempt.objects.get(id=a.id).released for a in reserved)  # the default
    reaper_run_once(now=db_now() + dt.timedelta(hours=1), config=ReaperConfig())

    charged, released = (Attempt.objects.get(id=a.id) for a in reserved)
    assert (charged.state, charged.released) == (AttemptState.TIMED_OUT, False)
    assert (released.state, released.released) == (AttemptState.LOST, True)
    assert released.error.endswith(RELEASED_ERROR)
    assert (attempts("timed_out"), attempts("lost")) == (1, 0)


def test_an_attempt_is_counted_by_how_it_ended_not_by_its_error_text(queued_run):
    attempt = claim(queued_run())
    assert attempt_fail(attempt=attempt, now=PINNED_NOW, error="x; not started", retry_at=None)
    assert attempts("failed") == 1


def test_the_histograms_drop_and_create_again_starting_from_the_finished_attempts(queued_run):
    attempt = claim(queued_run())
    assert attempt_fail(attempt=attempt, now=PINNED_NOW, error="x", retry_at=None)
    assert installed(HISTOGRAM_TRIGGERS) == 3
    run_script(STAGE_HISTOGRAMS.drop)
    assert installed(HISTOGRAM_TRIGGERS) == 0
    assert attempts("failed") == 0
    run_script(STAGE_HISTOGRAMS.create)
    assert installed(HISTOGRAM_TRIGGERS) == 3
    assert attempts("failed") == 1


def test_the_state_tallies_drop_and_create_again_starting_from_the_rows(queued_run):
    for n in range(3):
        queued_run(args=[n])
    assert (tally(RUNS_BY_STATE, 'state="queued"'), tally(OUTBOX_BACKLOG)) == (3, 3)
    run_script(STATE_TALLIES.drop)
    assert installed(name for name, _ in STATE_TALLY_TRIGGERS) == 0
    assert (tally(RUNS_BY_STATE, 'state="queued"'), tally(OUTBOX_BACKLOG)) == (0, 0)
    run_script(STATE_TALLIES.create)
    assert installed(name for name, _ in STATE_TALLY_TRIGGERS) == 6
    assert (tally(RUNS_BY_STATE, 'state="queued"'), tally(OUTBOX_BACKLOG)) == (3, 3)
    queued_run(args=[3])
    assert (tally(RUNS_BY_STATE, 'state="queued"'), tally(OUTBOX_BACKLOG)) == (4, 4)


def test_the_dead_letters_drop_and_create_again_keeping_the_failed_runs_deleted(queued_run):
    """Failed runs are counted as they fail; the drop keeps those no longer there in the
    tally retention used to keep, and the create starts from both again."""
    failed = []
    for n in range(3):
        attempt = claim(queued_run(args=[n]))
        assert attempt_fail(attempt=attempt, now=PINNED_NOW, error="x", retry_at=None)
        failed.append(attempt.run_id)
    assert tally(DEAD_LETTERS) == 3
    Attempt.objects.filter(run_id=failed[0]).delete()
    Run.objects.filter(id=failed[0]).delete()  # as retention does
    Run.objects.filter(id=failed[1]).update(state="queued")  # as a replay does
    assert tally(DEAD_LETTERS) == 3

    run_script(DEAD_LETTER_TALLY.drop)
    assert (installed(["run_failed_dead_letter"]), tally(DEAD_LETTERS)) == (0, 0)
    assert tally(DEAD_LETTERS_PRUNED) == 2  # 3 failures, 1 failed run left
    run_script(DEAD_LETTER_TALLY.create)
    assert installed(["run_failed_dead_letter"]) == 1
    assert (tally(DEAD_LETTERS), tally(DEAD_LETTERS_PRUNED)) == (3, 0)
