"""The tallies' triggers take no lock a claim, a cancel or a promotion waits on: two real
sessions, in the interleavings that deadlocked while every session upserted its shard of
shared tally rows (`pg_backend_pid() % 16`, row locks held until commit, ordered only within
one statement). Both sessions are made to fall in one such shard, so these tests fail on
that design whatever pids the server hands out.

- The materializer's cancel_previous (running -> cancelled, then a queued run inserted)
  against a claim (queued -> running).
- The materializer cancelling a retry_wait run against the promoter (retry_wait -> queued).
- A long transaction that changed a state against a claim: the claim does not wait.
- Successes whose run durations fall in opposite bucket orders (the stage histograms).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection, transaction
from django.db.models import Count

from dispatch.promoter import PromoterConfig, promoter_run_once
from jobs.clock import db_now
from jobs.models import Run, RunState
from jobs.transitions import attempt_fail, attempts_succeed, run_cancel
from storage.metrics import tallies_sum
from storage.tallies import RUN_DURATION, RUNS_BY_STATE
from tests.factories import PINNED_NOW, claim, make_job, scheduler_pass
from tests.threads import in_thread

pytestmark = pytest.mark.django_db(transaction=True)

OLD_SHARDS = 16  # the sharded design's shard count: mod(pg_backend_pid(), 16)
WAIT = 20.0


def same_old_shard() -> None:
    """Reconnect this thread's session until its pid falls in shard 0 of the old design."""
    while True:
        connection.ensure_connection()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            if cursor.fetchone()[0] % OLD_SHARDS == 0:
                return
        connection.close()


def blocked_or_done(done: threading.Event) -> None:
    """Until another session waits on a lock, or `done` is set (it did not need to wait)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and not done.is_set():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0]:
                return
        time.sleep(0.02)


def race(first: Callable[[], object], then: Callable[[], object], other: Callable[[], object]):
    """Session A, in one transaction: `first`, then (once session B waits on a lock, or has
    finished) `then`. Session B starts `other` after A's `first`. The errors of both."""
    errors: list = []
    first_done, other_done = threading.Event(), threading.Event()

    def session_a() -> None:
        same_old_shard()
        with transaction.atomic():
            first()
            first_done.set()
            blocked_or_done(other_done)
            then()

    def session_b() -> None:
        same_old_shard()
        assert first_done.wait(WAIT)
        try:
            other()
        finally:
            other_done.set()

    threads = [in_thread(session_a, errors), in_thread(session_b, errors)]
    for thread in threads:
        thread.join(2 * WAIT)
    assert not any(thread.is_alive() for thread in threads)
    return errors


def assert_runs_tallied() -> None:
    counted = dict(Run.objects.values_list("state").annotate(n=Count("id")))
    tallied = {
        labels.split('"')[1]: count
        for _, labels, count, _ in tallies_sum(names=[RUNS_BY_STATE])
        if count
    }
    assert tallied == counted


def due_job(user) -> None:
    """A one-time job the next scheduler pass materializes (a queued run, its outbox row)."""
    make_job(
        user,
        now=PINNED_NOW - dt.timedelta(minutes=1),
        schedule={"kind": "once", "run_at": PINNED_NOW.isoformat()},
    )


def test_cancel_previous_and_a_claim_do_not_deadlock(queued_run, user):
    """A: running -> cancelled, then a queued run inserted, in one transaction (the
    materializer's cancel_previous); B claims another run (queued -> running) between."""
    running, queued = queued_run(args=[1]), queued_run(args=[2])
    claim(running)
    due_job(user)
    errors = race(
        lambda: run_cancel(run_id=running.id, now=PINNED_NOW),
        lambda: scheduler_pass(PINNED_NOW),
        lambda: claim(queued),
    )
    assert errors == []
    assert Run.objects.get(id=queued.id).state == RunState.RUNNING
    assert Run.objects.filter(state=RunState.QUEUED).count() == 1  # the new one
    assert_runs_tallied()


def test_a_retry_wait_cancel_and_the_promoter_do_not_deadlock(queued_run, user):
    """A: retry_wait -> cancelled, then a queued run inserted (the materializer cancelling
    a retry_wait run); B, the promoter, queues another retry (retry_wait -> queued)."""
    waiting = [queued_run(args=[n], retry={"max_attempts": 3}) for n in range(2)]
    for run in waiting:
        attempt = claim(run)
        assert attempt_fail(attempt=attempt, now=PINNED_NOW, error="x", retry_at=PINNED_NOW)
    due_job(user)
    errors = race(
        lambda: run_cancel(run_id=waiting[0].id, now=PINNED_NOW),
        lambda: scheduler_pass(PINNED_NOW),
        lambda: promoter_run_once(
            now=PINNED_NOW + dt.timedelta(minutes=1), config=PromoterConfig()
        ),
    )
    assert errors == []
    assert Run.objects.get(id=waiting[1].id).state == RunState.QUEUED
    assert_runs_tallied()


def test_a_long_transaction_that_changed_a_state_does_not_hold_claims(queued_run):
    running, queued = queued_run(args=[1]), queued_run(args=[2])
    claim(running)
    claimed_in: list[float] = []
    release = threading.Event()

    def long_transaction() -> None:
        same_old_shard()
        with transaction.atomic():
            run_cancel(run_id=running.id, now=PINNED_NOW)
            release.wait(WAIT)

    def timed_claim() -> None:
        same_old_shard()
        started = time.monotonic()
        claim(queued)
        claimed_in.append(time.monotonic() - started)

    errors: list = []
    holder = in_thread(long_transaction, errors)
    time.sleep(0.5)
    claimer = in_thread(timed_claim, errors)
    claimer.join(10)  # the holder commits only after this
    release.set()
    holder.join(WAIT)
    claimer.join(WAIT)
    assert errors == []
    assert claimed_in[0] < 3  # not held until the other session commits


def test_successes_in_opposite_bucket_orders_do_not_deadlock(queued_run):
    """Each session ends a short run and a long one (run durations in two buckets of the
    stage histograms), in opposite orders."""
    runs = [queued_run(args=[n]) for n in range(4)]
    attempts = [claim(run) for run in runs]
    # Durations (to the database's now, when they succeed): runs 0 and 3 short, 1 and 2
    # about an hour.
    now = db_now()
    for index, started in enumerate([0.2, 3000, 3000, 0.2]):
        Run.objects.filter(id=runs[index].id).update(started_at=now - dt.timedelta(seconds=started))

    def succeed(index: int) -> Callable[[], object]:
        return lambda: attempts_succeed(outcomes=[(attempts[index], None)])

    def other_session() -> None:
        with transaction.atomic():
            succeed(1)()
            succeed(3)()

    errors = race(succeed(0), succeed(2), other_session)
    assert errors == []
    assert Run.objects.filter(state=RunState.SUCCEEDED).count() == 4
    observed = sum(count for *_, count, _ in tallies_sum(names=[RUN_DURATION]))
    assert observed == 4
