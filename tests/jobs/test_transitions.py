"""Run and attempt transitions (jobs.transitions) and the database constraints behind them.
Clocks are pinned."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import IntegrityError, transaction
from django.db.models import F

from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import Attempt, AttemptState, OutboxMessage, Run, RunKind, RunState
from jobs.transitions import (
    attempt_fail,
    attempt_renew_lease,
    attempt_succeed,
    attempts_renew_leases,
    run_claim,
    runs_requeue,
)
from tests import factories

pytestmark = pytest.mark.django_db

CREATED = dt.datetime(2029, 12, 31, 12, 0, tzinfo=dt.UTC)
RUN_AT = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
NOW = RUN_AT + dt.timedelta(seconds=1)
LEASE = 30.0
CONFIG = SchedulerConfig()


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


def reload(obj):
    obj.refresh_from_db()
    return obj


@pytest.fixture
def queued_run(make_job) -> Run:
    """A one-time job due at RUN_AT, materialized by the scheduler at NOW."""
    job = make_job(now=CREATED, schedule={"kind": "once", "run_at": RUN_AT.isoformat()})
    assert scheduler_run_once(now=NOW, config=SchedulerConfig()).runs_created == 1
    return Run.objects.get(job=job)


@pytest.fixture
def claimed(queued_run) -> Attempt:
    attempt = run_claim(run_id=queued_run.id, worker="worker-a", now=later(1), lease_seconds=LEASE)
    assert attempt is not None
    return attempt


def retry_and_reclaim(attempt: Attempt) -> Attempt:
    """Fail `attempt` into retry_wait, let the scheduler re-queue it, claim it again."""
    retry_at = later(60)
    assert attempt_fail(attempt=attempt, now=later(2), error="boom", retry_at=retry_at)
    assert (
        scheduler_run_once(now=retry_at + dt.timedelta(seconds=1), config=CONFIG).retries_queued
        == 1
    )
    assert reload(attempt.run).state == RunState.QUEUED
    again = run_claim(run_id=attempt.run_id, worker="worker-b", now=later(62), lease_seconds=LEASE)
    assert again is not None
    return again


# --- claim -----------------------------------------------------------------------------


def test_scheduler_creates_a_queued_run_with_its_outbox_message(queued_run):
    assert queued_run.state == RunState.QUEUED
    assert queued_run.kind == RunKind.SCHEDULED
    assert queued_run.scheduled_for == RUN_AT
    assert (queued_run.fencing_token, queued_run.attempt_count) == (0, 0)
    assert list(OutboxMessage.objects.values_list("run_id", flat=True)) == [queued_run.id]


def test_claim_creates_attempt_one_with_token_one_and_runs_the_run(queued_run):
    attempt = run_claim(run_id=queued_run.id, worker="worker-a", now=later(1), lease_seconds=LEASE)
    assert (attempt.number, attempt.fencing_token, attempt.state) == (1, 1, AttemptState.RUNNING)
    assert attempt.lease_expires_at == later(1 + LEASE)
    run = reload(queued_run)
    assert (run.state, run.fencing_token, run.attempt_count) == (RunState.RUNNING, 1, 1)
    assert run.started_at == later(1)


def test_second_claim_of_the_same_run_is_refused(claimed):
    """A duplicate delivery gets None and creates no attempt."""
    assert (
        run_claim(run_id=claimed.run_id, worker="worker-b", now=later(2), lease_seconds=LEASE)
        is None
    )
    assert Attempt.objects.filter(run_id=claimed.run_id).count() == 1
    assert reload(claimed.run).fencing_token == 1


# --- completion ------------------------------------------------------------------------


def test_succeed_with_the_current_token_finishes_the_run(claimed):
    assert attempt_succeed(attempt=claimed, now=later(5), result={"ok": True}) is True
    run = reload(claimed.run)
    assert (run.state, run.finished_at, run.result) == (RunState.SUCCEEDED, later(5), {"ok": True})
    assert (reload(claimed).state, claimed.finished_at) == (AttemptState.SUCCEEDED, later(5))


def test_retry_is_a_new_attempt_of_the_same_run_with_the_next_token(claimed):
    second = retry_and_reclaim(claimed)
    assert (second.run_id, second.number, second.fencing_token) == (claimed.run_id, 2, 2)
    assert Run.objects.count() == 1
    run = reload(claimed.run)
    assert (run.state, run.fencing_token, run.attempt_count) == (RunState.RUNNING, 2, 2)
    # started_at is when the run first started, not when the retry did.
    assert run.started_at == later(1)


def test_stale_attempt_cannot_succeed_or_change_anything(claimed):
    second = retry_and_reclaim(claimed)
    before_run = Run.objects.filter(id=claimed.run_id).values().get()
    before_attempts = list(Attempt.objects.order_by("number").values())

    assert attempt_succeed(attempt=claimed, now=later(70), result={"stale": True}) is False

    assert Run.objects.filter(id=claimed.run_id).values().get() == before_run
    assert list(Attempt.objects.order_by("number").values()) == before_attempts
    # ...and the current attempt still can.
    assert attempt_succeed(attempt=second, now=later(71)) is True
    assert reload(claimed.run).state == RunState.SUCCEEDED


def test_stale_token_is_refused_even_for_an_attempt_row_still_running(claimed):
    """The token, not only the attempt's state, guards the run: an attempt object that
    carries an old token cannot finish the current attempt's row."""
    second = retry_and_reclaim(claimed)
    impostor = Attempt.objects.get(id=second.id)
    impostor.fencing_token = 1
    assert attempt_succeed(attempt=impostor, now=later(70)) is False
    assert attempt_fail(attempt=impostor, now=later(70), error="x", retry_at=None) is False
    assert reload(second).state == AttemptState.RUNNING
    assert reload(second.run).state == RunState.RUNNING


def test_fail_with_retry_at_waits_for_the_retry(claimed):
    retry_at = later(60)
    assert attempt_fail(attempt=claimed, now=later(5), error="boom", retry_at=retry_at) is True
    run = reload(claimed.run)
    assert (run.state, run.next_attempt_at) == (RunState.RETRY_WAIT, retry_at)
    assert run.finished_at is None
    assert (reload(claimed).state, claimed.error) == (AttemptState.FAILED, "boom")


def test_retry_wait_is_not_requeued_before_next_attempt_at(claimed):
    assert attempt_fail(attempt=claimed, now=later(5), error="boom", retry_at=later(60))
    assert scheduler_run_once(now=later(59), config=CONFIG).retries_queued == 0
    assert reload(claimed.run).state == RunState.RETRY_WAIT


def test_fail_without_retry_at_fails_the_run_as_exhausted(claimed):
    assert attempt_fail(attempt=claimed, now=later(5), error="boom", retry_at=None) is True
    run = reload(claimed.run)
    assert (run.state, run.failure_reason) == (RunState.FAILED, "exhausted")
    assert run.finished_at == later(5)


# --- refused transitions ---------------------------------------------------------------


def test_finished_attempt_cannot_finish_again(claimed):
    assert attempt_succeed(attempt=claimed, now=later(5))
    assert attempt_succeed(attempt=claimed, now=later(6)) is False
    assert attempt_fail(attempt=claimed, now=later(6), error="late", retry_at=None) is False
    run = reload(claimed.run)
    assert (run.state, run.finished_at, run.failure_reason) == (RunState.SUCCEEDED, later(5), "")
    assert (reload(claimed).state, claimed.finished_at) == (AttemptState.SUCCEEDED, later(5))


def test_succeeded_run_cannot_be_requeued_or_claimed(claimed):
    assert attempt_succeed(attempt=claimed, now=later(5))
    assert runs_requeue(run_ids=[claimed.run_id]) == 0
    assert run_claim(run_id=claimed.run_id, worker="w", now=later(6), lease_seconds=LEASE) is None
    assert reload(claimed.run).state == RunState.SUCCEEDED


def test_running_run_cannot_be_requeued(claimed):
    assert runs_requeue(run_ids=[claimed.run_id]) == 0
    assert reload(claimed.run).state == RunState.RUNNING


def test_claim_of_an_unknown_run_is_none(db):
    import uuid

    assert run_claim(run_id=uuid.uuid4(), worker="w", now=NOW, lease_seconds=LEASE) is None


# --- lease -----------------------------------------------------------------------------


def test_renew_extends_the_lease_of_the_current_attempt(claimed):
    assert attempt_renew_lease(attempt=claimed, now=later(20), lease_seconds=LEASE) is True
    reload(claimed)
    assert (claimed.lease_expires_at, claimed.heartbeat_at) == (later(20 + LEASE), later(20))


def test_renew_is_refused_for_a_stale_attempt(claimed):
    second = retry_and_reclaim(claimed)
    old_lease = reload(claimed).lease_expires_at
    assert attempt_renew_lease(attempt=claimed, now=later(100), lease_seconds=LEASE) is False
    assert reload(claimed).lease_expires_at == old_lease
    assert attempt_renew_lease(attempt=second, now=later(100), lease_seconds=LEASE) is True
    assert reload(second).lease_expires_at == later(100 + LEASE)


def test_renew_is_refused_after_the_attempt_finished(claimed):
    assert attempt_succeed(attempt=claimed, now=later(5))
    assert attempt_renew_lease(attempt=claimed, now=later(6), lease_seconds=LEASE) is False
    assert reload(claimed).lease_expires_at == later(1 + LEASE)


# --- scheduler -------------------------------------------------------------------------


# --- database constraints --------------------------------------------------------------


def test_second_scheduled_run_for_one_occurrence_is_refused_by_the_database(queued_run):
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.create(
            job_id=queued_run.job_id,
            job_version_id=queued_run.job_version_id,
            kind=RunKind.SCHEDULED,
            state=RunState.QUEUED,
            scheduled_for=queued_run.scheduled_for,
            due_at=queued_run.scheduled_for,
            created_at=NOW,
            idempotency_key="another-key",
        )


def test_manual_run_at_the_same_instant_is_allowed(queued_run):
    """The one-per-occurrence constraint is only on scheduled runs."""
    Run.objects.create(
        job_id=queued_run.job_id,
        job_version_id=queued_run.job_version_id,
        kind=RunKind.MANUAL,
        state=RunState.QUEUED,
        scheduled_for=queued_run.scheduled_for,
        due_at=queued_run.scheduled_for,
        created_at=NOW,
        idempotency_key="manual-key",
    )
    assert Run.objects.filter(job_id=queued_run.job_id).count() == 2


def test_second_running_attempt_of_a_run_is_refused_by_the_database(claimed):
    with pytest.raises(IntegrityError), transaction.atomic():
        Attempt.objects.create(
            run_id=claimed.run_id,
            number=2,
            fencing_token=2,
            state=AttemptState.RUNNING,
            lease_expires_at=later(100),
            heartbeat_at=later(2),
            started_at=later(2),
        )


def test_a_claim_returns_the_run_and_its_spec_and_stamps_the_publication(user):
    run = factories.queued_run(user, args=[1], heartbeat_timeout_seconds=45, timeout_seconds=600)
    published = later(-2)

    attempt = run_claim(run_id=run.id, worker="w", now=NOW, published_at=published)

    assert attempt.run.id == run.id and attempt.run.idempotency_key == run.idempotency_key
    assert attempt.run.job_version.spec["args"] == [1]
    assert attempt.lease_expires_at == NOW + dt.timedelta(seconds=45)
    assert attempt.deadline_at == NOW + dt.timedelta(seconds=600)
    stored = Attempt.objects.get(id=attempt.id)
    assert (stored.number, stored.fencing_token, stored.lease_expires_at) == (
        1, 1, NOW + dt.timedelta(seconds=45)
    )  # fmt: skip
    run.refresh_from_db()
    assert (run.published_at, run.started_at) == (published, NOW)


def test_leases_are_renewed_together_and_a_stale_one_is_left_out(user):
    first, second = (
        run_claim(run_id=factories.queued_run(user).id, worker="w", now=NOW, lease_seconds=LEASE)
        for _ in range(2)
    )
    Run.objects.filter(id=second.run_id).update(fencing_token=F("fencing_token") + 1)
    Attempt.objects.filter(id=second.id).update(state=AttemptState.LOST)

    renewed = attempts_renew_leases(
        leases=[(first.id, first.fencing_token, 90), (second.id, second.fencing_token, 90)],
        now=later(10),
    ).renewed

    assert renewed == {first.id}
    assert Attempt.objects.get(id=first.id).lease_expires_at == later(100)
