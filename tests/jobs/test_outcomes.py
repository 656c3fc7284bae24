"""The outcome service (jobs.outcomes): successes and failures recorded in batches, each
only while its attempt holds its run's current token, and runs left running without a live
attempt. Clocks are pinned."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction

from jobs.models import Attempt, AttemptState, AuditEvent, FailureReason, Run, RunState
from jobs.outcomes import (
    Failure,
    Success,
    attempts_record_failure,
    attempts_record_success,
    runs_record_orphaned,
)
from jobs.transitions import run_claim
from tests.factories import PINNED_NOW

pytestmark = pytest.mark.django_db

NOW = PINNED_NOW


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


@pytest.fixture
def claimed(queued_run):
    """claimed(**job_overrides): a queued run's attempt, claimed at NOW."""

    def make(**overrides) -> Attempt:
        run = queued_run(**overrides)
        return run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=30)

    return make


def failure(attempt: Attempt, *, ended=AttemptState.FAILED, retryable=True) -> Failure:
    run = attempt.run
    return Failure(attempt=attempt, spec=run.job_version.spec, retry_base=run.retry_base,
                   ended=ended, error="boom", retryable=retryable)  # fmt: skip


def test_failures_of_a_batch_are_retried_or_failed_each_by_its_policy(claimed):
    retried = claimed(retry={"max_attempts": 3, "jitter": False, "initial_delay_seconds": 10})
    refused = claimed()
    lost = claimed(retry={"max_attempts": 1})
    stale = claimed()
    Run.objects.filter(id=stale.run_id).update(fencing_token=9)  # its run moved on

    outcomes = attempts_record_failure(
        failures=[failure(retried), failure(refused, retryable=False),
                  failure(lost, ended=AttemptState.LOST), failure(stale)],
        now=later(5),
        by="test",
    )  # fmt: skip

    assert outcomes == {
        retried.id: RunState.RETRY_WAIT,
        refused.id: RunState.FAILED,
        lost.id: RunState.FAILED,
        stale.id: None,
    }
    run = Run.objects.get(id=retried.run_id)
    assert (run.state, run.next_attempt_at) == (RunState.RETRY_WAIT, later(15))
    assert Run.objects.get(id=refused.run_id).failure_reason == FailureReason.ERROR
    assert Run.objects.get(id=lost.run_id).failure_reason == FailureReason.LOST
    assert Attempt.objects.get(id=lost.id).state == AttemptState.LOST
    assert Attempt.objects.get(id=stale.id).state == AttemptState.RUNNING
    # Only an attempt the handler did not end itself is audited as such.
    audited = AuditEvent.objects.filter(action__startswith="attempt.")
    assert list(audited.values_list("action", "actor_label")) == [("attempt.lost", "system:test")]


def test_successes_of_a_batch_win_while_they_hold_their_token(claimed):
    first, stale = claimed(), claimed()
    Run.objects.filter(id=stale.run_id).update(fencing_token=9)

    with transaction.atomic():
        won = attempts_record_success(successes=[Success(first, {"ok": 1}), Success(stale, None)])

    assert won == {first.id}
    run = Run.objects.get(id=first.run_id)
    assert (run.state, run.result) == (RunState.SUCCEEDED, {"ok": 1})
    assert Run.objects.get(id=stale.run_id).state == RunState.RUNNING


def test_orphaned_runs_end_as_a_lost_attempt_would(claimed):
    retried, exhausted = claimed(), claimed(retry={"max_attempts": 1})
    Attempt.objects.filter(id__in=[retried.id, exhausted.id]).update(state=AttemptState.LOST)
    runs = list(Run.objects.select_related("job_version").filter(
        id__in=[retried.run_id, exhausted.run_id]
    ))  # fmt: skip

    moved = runs_record_orphaned(runs=runs, now=later(5))

    assert moved == {retried.run_id: RunState.RETRY_WAIT, exhausted.run_id: RunState.FAILED}
    assert Run.objects.get(id=exhausted.run_id).failure_reason == FailureReason.LOST
    assert runs_record_orphaned(runs=runs, now=later(6)) == {}  # no longer running
