"""storage.tallies: the triggers that keep the metrics' tallies, as their Ddl values install
and remove them, against PostgreSQL: a released attempt is told by its column, each Ddl's
create starts its tallies from the rows already there, the triggers only append deltas,
and a roll-up moves them into one row per series without changing a figure, two roll-ups
at once included."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import pytest
from django.db import connection, transaction

from dispatch.reaper import ReaperConfig, reaper_run_once
from jobs.clock import db_now
from jobs.models import Attempt, AttemptState, Run, Tally, TallyDelta
from jobs.transitions import RELEASED_ERROR, attempt_fail, runs_reserve
from storage.metrics import tallies_sum
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
    tallies_roll_up,
)
from tests.factories import PINNED_NOW, claim
from tests.threads import in_thread

pytestmark = pytest.mark.django_db

HISTOGRAM_TRIGGERS = ("run_measure_insert", "run_measure_update", "attempt_measure_finish")


def tally(name: str, labels: str = "") -> int:
    """The series as /metrics reads it: rolled-up rows plus pending deltas."""
    return sum(t.count for t in tallies_sum(names=[name]) if t.labels == labels)


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


def test_the_triggers_append_deltas_and_a_roll_up_moves_them_without_changing_a_figure(
    queued_run,
):
    attempt = claim(queued_run(args=[0]))
    queued_run(args=[1])
    assert attempt_fail(attempt=attempt, now=PINNED_NOW, error="x", retry_at=None)
    before = sorted(tallies_sum(names=[RUNS_BY_STATE, OUTBOX_BACKLOG, ATTEMPTS]))
    assert not Tally.objects.filter(name=RUNS_BY_STATE).exists()  # nothing updated
    deltas = TallyDelta.objects.count()
    assert deltas > 0

    assert tallies_roll_up(limit=2) == 2
    assert TallyDelta.objects.count() == deltas - 2
    assert sorted(tallies_sum(names=[RUNS_BY_STATE, OUTBOX_BACKLOG, ATTEMPTS])) == before
    assert tallies_roll_up(limit=10_000) == deltas - 2
    assert tallies_roll_up(limit=10_000) == 0
    assert not TallyDelta.objects.exists()
    assert sorted(tallies_sum(names=[RUNS_BY_STATE, OUTBOX_BACKLOG, ATTEMPTS])) == before
    # One rolled-up row per series (running: claimed, then failed).
    rows = Tally.objects.filter(name=RUNS_BY_STATE).values_list("labels", "shard", "count")
    assert sorted(rows) == [
        ('state="failed"', 0, 1),
        ('state="queued"', 0, 1),
        ('state="running"', 0, 0),
    ]


@pytest.mark.django_db(transaction=True)
def test_two_roll_ups_at_once_take_disjoint_deltas_and_lose_none(queued_run):
    """A roll-up holds its transaction open; a second one meanwhile takes the other deltas
    (SKIP LOCKED) and waits, at most, on the rolled-up rows the first added to."""
    for n in range(3):
        queued_run(args=[n])
    names = [RUNS_BY_STATE, OUTBOX_BACKLOG]
    before = sorted(tallies_sum(names=names))
    deltas = TallyDelta.objects.count()
    rolled: dict[str, int] = {}
    first_done, release = threading.Event(), threading.Event()

    def first() -> None:
        with transaction.atomic():
            rolled["first"] = tallies_roll_up(limit=2)
            first_done.set()
            release.wait(20)

    def second() -> None:
        assert first_done.wait(20)
        rolled["second"] = tallies_roll_up(limit=10_000)

    errors: list = []
    threads = [in_thread(first, errors), in_thread(second, errors)]
    assert first_done.wait(20)
    time.sleep(0.3)  # the second takes its deltas, and may wait on a rolled-up row
    release.set()
    for thread in threads:
        thread.join(20)
    assert errors == []
    assert rolled == {"first": 2, "second": deltas - 2}
    assert not TallyDelta.objects.exists()
    assert sorted(tallies_sum(names=names)) == before
