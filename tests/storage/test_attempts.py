"""storage.attempts against PostgreSQL: lease renewals, the batched success, the bounded
lock wait, and their races on two real connections."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import OperationalError, transaction

from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.transitions import run_claim
from storage.attempts import (
    LeaseRenewal,
    Success,
    attempts_renew_leases,
    attempts_succeed,
    lock_timeout_set_local,
)
from tests.factories import PINNED_NOW
from tests.threads import in_thread

NOW = PINNED_NOW


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


@pytest.fixture
def claimed(queued_run):
    """claimed(): a queued run's attempt, claimed at NOW with a 30 s lease."""

    def make() -> Attempt:
        run = queued_run()
        return run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=30)

    return make


def success(attempt: Attempt, result=None, *, token: int | None = None) -> Success:
    token = attempt.fencing_token if token is None else token
    return Success(attempt_id=attempt.id, run_id=attempt.run_id, token=token, result=result,
                   started_at=None)  # fmt: skip


@pytest.mark.django_db
def test_renewals_extend_the_leases_of_attempts_that_hold_their_token(claimed):
    held, stale, ended = claimed(), claimed(), claimed()
    Attempt.objects.filter(id=ended.id).update(state=AttemptState.LOST)

    renewed = attempts_renew_leases(
        leases=[LeaseRenewal(held.id, held.fencing_token, 60.0),
                LeaseRenewal(stale.id, stale.fencing_token + 1, 60.0),
                (ended.id, ended.fencing_token, 60.0)],
        now=later(10),
    ).renewed  # fmt: skip

    assert renewed == {held.id}
    held.refresh_from_db()
    assert (held.heartbeat_at, held.lease_expires_at) == (later(10), later(70))
    stale.refresh_from_db()
    assert stale.lease_expires_at == later(30)
    assert attempts_renew_leases(leases=[]) == (set(), set())


@pytest.mark.django_db
def test_a_renewal_without_an_instant_takes_the_database_clock(claimed):
    attempt = claimed()

    renewal = attempts_renew_leases(leases=[(attempt.id, attempt.fencing_token, 30.0)])
    assert renewal == ({attempt.id}, set())
    attempt.refresh_from_db()
    # The database's clock, not the pinned one the claim used.
    assert abs(attempt.heartbeat_at - dt.datetime.now(dt.UTC)) < dt.timedelta(minutes=1)
    assert attempt.lease_expires_at == attempt.heartbeat_at + dt.timedelta(seconds=30)


@pytest.mark.django_db
def test_successes_move_attempts_and_runs_together_while_they_hold_their_token(claimed):
    first, second, stale = claimed(), claimed(), claimed()

    with transaction.atomic():
        succeeded = attempts_succeed(
            successes=[success(first, {"rows": 3}), success(second),
                       success(stale, token=stale.fencing_token + 1)]
        )  # fmt: skip

    assert succeeded.won == {first.id, second.id} and succeeded.runs_moved == 2
    run = Run.objects.get(id=first.run_id)
    assert (run.state, run.result, run.failure_reason) == (RunState.SUCCEEDED, {"rows": 3}, "")
    assert Run.objects.get(id=second.run_id).result is None  # SQL NULL, as the ORM stores it
    assert Attempt.objects.get(id=first.id).state == AttemptState.SUCCEEDED
    assert Attempt.objects.get(id=stale.id).state == AttemptState.RUNNING
    assert Run.objects.get(id=stale.run_id).state == RunState.RUNNING
    assert attempts_succeed(successes=[]).won == set()


@pytest.mark.django_db
def test_a_reserved_attempt_s_start_is_written_with_its_success(claimed):
    attempt = claimed()
    Attempt.objects.filter(id=attempt.id).update(started_at=None)
    Run.objects.filter(id=attempt.run_id).update(started_at=None)

    with transaction.atomic():
        won = attempts_succeed(
            successes=[success(attempt)._replace(started_at=later(3))]
        ).won  # fmt: skip

    assert won == {attempt.id}
    assert Attempt.objects.get(id=attempt.id).started_at == later(3)
    assert Run.objects.get(id=attempt.run_id).started_at == later(3)


@pytest.mark.django_db(transaction=True)
def test_a_renewal_meeting_a_success_passes_it_over_then_finds_it_ended(claimed):
    """The renewal does not wait for the row a success holds: it reports it held
    elsewhere; once the success commits, the attempt is no longer running and keeps its
    final state."""
    attempt = claimed()
    written = threading.Event()
    commit = threading.Event()
    results: dict[str, object] = {}
    lease = [(attempt.id, attempt.fencing_token, 30.0)]

    def succeed() -> None:
        with transaction.atomic():
            results["won"] = attempts_succeed(successes=[success(attempt)]).won
            written.set()
            commit.wait(10)

    thread = in_thread(succeed)
    assert written.wait(10)
    try:
        assert attempts_renew_leases(leases=lease) == (set(), {attempt.id})
    finally:
        commit.set()
        thread.join(10)

    assert results == {"won": {attempt.id}}
    assert attempts_renew_leases(leases=lease) == (set(), set())
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_bounded_lock_wait_gives_up_on_a_held_row(claimed):
    attempt = claimed()
    locked = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with transaction.atomic():
            list(Run.objects.select_for_update().filter(id=attempt.run_id))
            locked.set()
            release.wait(10)

    thread = in_thread(hold)
    assert locked.wait(10)
    try:
        with pytest.raises(OperationalError, match="lock timeout"):
            with transaction.atomic():
                lock_timeout_set_local(seconds=0.2)
                Run.objects.filter(id=attempt.run_id).update(republish_count=1)
    finally:
        release.set()
        thread.join(10)
    with transaction.atomic():  # the bound ended with its transaction
        lock_timeout_set_local(seconds=0.2)
        assert Run.objects.filter(id=attempt.run_id).update(republish_count=1) == 1


@pytest.mark.django_db(transaction=True)
def test_a_bounded_lock_wait_needs_a_transaction_block():
    with pytest.raises(RuntimeError):
        lock_timeout_set_local(seconds=1)


@pytest.mark.django_db(transaction=True)
def test_a_renewal_passes_over_an_attempt_another_session_holds(claimed):
    """A reaper frozen while ending one expired attempt holds its row: the renewal of the
    same worker's other attempts goes on at once, and says which row it could not reach."""
    held, free = claimed(), claimed()
    locked, release = threading.Event(), threading.Event()

    def frozen_reaper() -> None:
        with transaction.atomic():
            Attempt.objects.filter(id=held.id, state=AttemptState.RUNNING).update(
                state=AttemptState.LOST
            )
            locked.set()
            release.wait(5)
            transaction.set_rollback(True)

    thread = in_thread(frozen_reaper)
    assert locked.wait(10)
    try:
        started = time.monotonic()
        renewal = attempts_renew_leases(
            leases=[(held.id, held.fencing_token, 60.0), (free.id, free.fencing_token, 60.0)],
            now=later(10),
        )
        waited = time.monotonic() - started
    finally:
        release.set()
        thread.join(10)
    assert waited < 1.0, f"the renewal waited {waited:.1f}s for the held row"
    assert (renewal.renewed, renewal.held_elsewhere) == ({free.id}, {held.id})
    assert Attempt.objects.get(id=free.id).lease_expires_at == later(70)
    assert Attempt.objects.get(id=held.id).lease_expires_at == later(30)  # untouched


def test_a_success_inserts_the_manifests_of_the_attempts_that_won_only(claimed):
    from logs_app.models import LogManifest
    from storage.logs import LogManifestRow

    won, stale = claimed(), claimed()

    def manifest(attempt: Attempt) -> LogManifestRow:
        return LogManifestRow(attempt_id=attempt.id, chunk_count=0, line_count=0, byte_count=0,
                              sha256="e3b0", dropped_lines=2, created_at=None)  # fmt: skip

    with transaction.atomic():
        succeeded = attempts_succeed(
            successes=[success(won), success(stale, token=stale.fencing_token + 1)],
            manifests=[manifest(won), manifest(stale)],
        )
    assert succeeded.won == {won.id}
    sealed = LogManifest.objects.get(attempt_id=won.id)
    assert (sealed.chunk_count, sealed.dropped_lines, sealed.sha256) == (0, 2, "e3b0")
    assert not LogManifest.objects.filter(attempt_id=stale.id).exists()
