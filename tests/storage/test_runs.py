"""storage.runs against PostgreSQL: the claim and the reservation, reconciliation's mark of
held runs, and their races on two real connections."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
from django.db import transaction
from django.db.models import F

from jobs.models import Attempt, AttemptState, OutboxMessage, Run, RunState
from jobs.transitions import runs_stamp_published_late
from storage.runs import run_claim, runs_mark_held, runs_reserve
from tests.factories import PINNED_NOW
from tests.threads import in_thread, wait_for_lock_waiters

NOW = PINNED_NOW


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


@pytest.mark.django_db
def test_a_claim_moves_a_queued_run_to_running_with_a_new_attempt(queued_run):
    run = queued_run(timeout_seconds=600)
    claim_id = uuid.uuid4()

    claimed = run_claim(run_id=run.id, worker="w", claim_id=claim_id, now=NOW, lease_seconds=30,
                        published_at=later(-5), task_id="t-1")  # fmt: skip

    assert claimed is not None
    assert (claimed.id, claimed.fencing_token, claimed.attempt_count) == (run.id, 1, 1)
    assert claimed.spec["task"] == run.job_version.spec["task"]
    assert (claimed.now, claimed.lease_expires_at, claimed.deadline_at) == (
        NOW, later(30), later(600)
    )  # fmt: skip
    attempt = Attempt.objects.get(id=claimed.attempt_id)
    assert (attempt.state, attempt.number, attempt.fencing_token) == (AttemptState.RUNNING, 1, 1)
    assert (attempt.worker, attempt.claim_id, attempt.task_id) == ("w", claim_id, "t-1")
    assert attempt.started_at == attempt.heartbeat_at == NOW
    run.refresh_from_db()
    assert (run.state, run.started_at, run.published_at) == (RunState.RUNNING, NOW, later(-5))


@pytest.mark.django_db
def test_a_claim_takes_the_leases_and_timeouts_of_the_spec_by_default(queued_run):
    run = queued_run(heartbeat_timeout_seconds=45, timeout_seconds=90)

    claimed = run_claim(run_id=str(run.id), worker="w", claim_id=None, now=NOW)

    assert (claimed.lease_expires_at, claimed.deadline_at) == (later(45), later(90))


@pytest.mark.django_db
def test_a_run_that_is_not_queued_is_not_claimed(queued_run):
    run = queued_run()
    assert run_claim(run_id=run.id, worker="w", claim_id=None, now=NOW) is not None

    assert run_claim(run_id=run.id, worker="w", claim_id=None, now=NOW) is None  # running
    assert run_claim(run_id=uuid.uuid4(), worker="w", claim_id=None, now=NOW) is None
    assert Attempt.objects.filter(run=run).count() == 1


@pytest.mark.django_db(transaction=True)
def test_of_two_concurrent_claims_of_one_run_one_wins(queued_run):
    """The first claim holds the run's row lock until its commit; the second waits on it,
    then finds the run running and claims nothing."""
    run = queued_run()
    claimed = threading.Event()
    commit = threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        with transaction.atomic():
            results["first"] = run_claim(run_id=run.id, worker="a", claim_id=None)
            claimed.set()
            commit.wait(10)

    def second() -> None:
        results["second"] = run_claim(run_id=run.id, worker="b", claim_id=None)

    threads = [in_thread(first)]
    assert claimed.wait(10)
    threads.append(in_thread(second))
    wait_for_lock_waiters(1)
    commit.set()
    for thread in threads:
        thread.join(10)

    assert results["first"] is not None and results["second"] is None
    assert list(Attempt.objects.filter(run=run).values_list("worker", flat=True)) == ["a"]


@pytest.mark.django_db
def test_a_reservation_reserves_the_first_attempts_of_a_pack_in_its_order(queued_run):
    first, second = queued_run(timeout_seconds=10), queued_run(timeout_seconds=20)
    claim_id = uuid.uuid4()

    reserved = runs_reserve(run_ids=[second.id, first.id], worker="w", claim_id=claim_id,
                            task_id="pack", grace_seconds=5)  # fmt: skip

    assert [row.id for row in reserved] == [second.id, first.id]
    assert reserved[0].attempt_id < reserved[1].attempt_id
    # Each run's deadline leaves room for every run before it, at its limit and grace.
    now = reserved[0].now
    assert reserved[0].deadline_at == now + dt.timedelta(seconds=20)
    assert reserved[1].deadline_at == now + dt.timedelta(seconds=20 + 5 + 10)
    attempts = Attempt.objects.filter(claim_id=claim_id)
    assert {attempt.started_at for attempt in attempts} == {None}  # reserved, not started
    assert {attempt.state for attempt in attempts} == {AttemptState.RUNNING}
    assert set(
        Run.objects.filter(id__in=[first.id, second.id]).values_list("state", flat=True)
    ) == {RunState.RUNNING}


@pytest.mark.django_db
def test_a_reservation_skips_at_most_once_runs_and_retries(queued_run):
    at_most_once = queued_run(delivery="at_most_once")
    retried = queued_run()
    Run.objects.filter(id=retried.id).update(attempt_count=1)  # not its first attempt
    plain = queued_run()

    reserved = runs_reserve(run_ids=[at_most_once.id, retried.id, plain.id], worker="w",
                            claim_id=uuid.uuid4())  # fmt: skip

    assert [row.id for row in reserved] == [plain.id]
    assert reserved[0].deadline_at is not None
    assert runs_reserve(run_ids=[], worker="w", claim_id=uuid.uuid4()) == []


@pytest.mark.django_db(transaction=True)
def test_two_overlapping_reservations_reserve_each_run_once(queued_run):
    """Both lock the pack's runs in the order of their ids: the second waits for the
    first's commit (no deadlock, whatever order the packs list them in), then finds them
    running."""
    first, second = queued_run(), queued_run()
    reserved = threading.Event()
    commit = threading.Event()
    results: dict[str, list] = {}

    def one() -> None:
        with transaction.atomic():
            results["one"] = runs_reserve(run_ids=[first.id, second.id], worker="a",
                                          claim_id=uuid.uuid4())  # fmt: skip
            reserved.set()
            commit.wait(10)

    def other() -> None:
        results["other"] = runs_reserve(run_ids=[second.id, first.id], worker="b",
                                        claim_id=uuid.uuid4())  # fmt: skip

    threads = [in_thread(one)]
    assert reserved.wait(10)
    threads.append(in_thread(other))
    wait_for_lock_waiters(1)
    commit.set()
    for thread in threads:
        thread.join(10)

    assert len(results["one"]) == 2 and results["other"] == []
    assert Attempt.objects.filter(run__in=[first, second]).count() == 2


def _mark(at: dt.datetime, **kwargs) -> int:
    """runs_mark_held as reconciliation calls it at `at` with its default wait (300 s)."""
    before = at - dt.timedelta(seconds=300)
    return runs_mark_held(updated_before=before, pending_before=before, limit=100, **kwargs)


@pytest.mark.django_db
def test_only_runs_whose_message_waits_in_the_outbox_are_marked_held_until_stamped(queued_run):
    held, published, recent = queued_run(), queued_run(), queued_run()
    OutboxMessage.objects.filter(run=published).delete()
    OutboxMessage.objects.filter(run=recent).update(created_at=later(3600))
    for run in (held, published, recent):
        Run.objects.filter(id=run.id).update(updated_at=NOW)

    assert _mark(later(600), ids=[published.id, recent.id]) == 0
    assert _mark(later(600)) == 1
    assert _mark(later(600)) == 0  # marked: out of run_queued_unheld_idx
    marks = dict(Run.objects.values_list("id", "held_at"))
    assert marks == {held.id: NOW, published.id: None, recent.id: None}
    # Published late: the relay stamps updated_at, and the mark no longer holds.
    assert runs_stamp_published_late(run_ids=[held.id], now=later(900)) == 1
    assert Run.objects.filter(id=held.id).exclude(held_at=F("updated_at")).exists()


@pytest.mark.django_db(transaction=True)
def test_a_run_a_relay_is_stamping_is_passed_over_and_stays_unmarked(queued_run):
    """A relay publishing the run late holds its row (outbox row deleted, updated_at
    stamped, not yet committed): the mark skips it, and after the commit finds it
    published."""
    run = queued_run()
    Run.objects.filter(id=run.id).update(updated_at=NOW)
    holding, release = threading.Event(), threading.Event()
    errors: list = []

    def publish_and_hold() -> None:
        with transaction.atomic():
            OutboxMessage.objects.filter(run=run).delete()
            runs_stamp_published_late(run_ids=[run.id], now=later(500))
            holding.set()
            release.wait(10)

    thread = in_thread(publish_and_hold, errors)
    try:
        assert holding.wait(10)
        assert _mark(later(600)) == 0
    finally:
        release.set()
        thread.join(10)
    assert errors == []
    assert _mark(later(600)) == 0
    assert Run.objects.get(id=run.id).held_at is None
