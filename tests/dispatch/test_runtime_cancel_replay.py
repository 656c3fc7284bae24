"""Cancel and replay through the API, and what the worker runtime then does with the run:
refuses it, stops its handler, or runs it again under the next fencing token. Also the
handler outcomes that end a run without a retry (NonRetryableError, the soft time limit)."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection
from rest_framework.test import APIClient

from dispatch import NonRetryableError, StaleAttempt
from dispatch.runtime import LeaseKeeper, RunContext, run_execute_delivery
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import (
    Attempt,
    AttemptState,
    AuditEvent,
    Counter,
    Effect,
    Job,
    JobState,
    OutboxMessage,
    OutboxState,
    Run,
    RunState,
)
from jobs.transitions import attempt_fail, attempt_succeed, run_claim
from tests.factories import PINNED_NOW

NOW = PINNED_NOW
LEASE = 30.0


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


def counter(name: str, labels: str = "") -> int:
    return sum(Counter.objects.filter(name=name, labels=labels).values_list("value", flat=True))


def snapshot(run_id) -> tuple[dict, list[dict], list[dict]]:
    return (
        Run.objects.filter(id=run_id).values().get(),
        list(Attempt.objects.filter(run_id=run_id).order_by("number").values()),
        list(OutboxMessage.objects.filter(run_id=run_id).order_by("id").values()),
    )


def cancel(api: APIClient, run: Run):
    return api.post(f"/api/v1/runs/{run.id}/cancel/")


def replay(api: APIClient, run: Run):
    return api.post(f"/api/v1/runs/{run.id}/replay/")


def publish(run: Run) -> None:
    assert OutboxMessage.objects.filter(run=run, state=OutboxState.PENDING).update(
        state=OutboxState.PUBLISHED, published_at=NOW
    )


class Handler:
    """Records its calls; never expected to be called where the run was refused."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, ctx):
        self.calls.append(ctx.attempt)
        return {"ran": True}


def claim(run: Run, *, at: dt.datetime = NOW) -> Attempt:
    attempt = run_claim(run_id=run.id, worker="worker-a", now=at, lease_seconds=LEASE)
    assert attempt is not None
    return attempt


def assert_worker_refuses_cancelled(run: Run) -> None:
    handler = Handler()
    result = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    assert result == {"run_id": str(run.id), "outcome": "cancelled"}
    assert handler.calls == []
    assert not Attempt.objects.filter(run=run).exists()
    run.refresh_from_db()
    assert (run.state, run.duplicate_deliveries, run.fencing_token) == (RunState.CANCELLED, 0, 0)
    assert counter("scheduler_duplicate_deliveries_total") == 0
    assert not AuditEvent.objects.filter(run=run, action="run.duplicate_delivery_refused").exists()


# --- cancel ----------------------------------------------------------------------------


def test_cancel_of_a_queued_run_deletes_its_unsent_message_and_the_worker_refuses_it(
    api, user, queued_run
):
    run = queued_run()
    assert OutboxMessage.objects.filter(run=run, state=OutboxState.PENDING).count() == 1

    response = cancel(api, run)

    assert response.status_code == 200, response.content
    assert response.json()["state"] == RunState.CANCELLED
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and run.finished_at is not None
    assert not OutboxMessage.objects.filter(run=run).exists()
    event = AuditEvent.objects.get(run=run, action="run.cancelled")
    assert (event.actor, event.actor_label, event.job_id) == (
        user,
        f"user:{user.username}",
        run.job_id,
    )
    assert event.data == {"from_state": RunState.QUEUED}
    assert_worker_refuses_cancelled(run)


def test_cancel_of_a_published_queued_run_keeps_the_sent_row_and_the_worker_refuses_it(
    api, queued_run
):
    run = queued_run()
    publish(run)

    response = cancel(api, run)

    assert response.status_code == 200, response.content
    assert Run.objects.get(id=run.id).state == RunState.CANCELLED
    assert OutboxMessage.objects.get(run=run).state == OutboxState.PUBLISHED
    assert AuditEvent.objects.filter(run=run, action="run.cancelled").count() == 1
    assert_worker_refuses_cancelled(run)


def test_cancel_of_a_running_run_ends_its_attempt_and_refuses_the_worker(api, queued_run):
    run = queued_run()
    publish(run)
    attempt = claim(run)

    response = cancel(api, run)

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["state"] == RunState.CANCELLED
    assert [a["state"] for a in body["attempts"]] == [AttemptState.CANCELLED]
    attempt.refresh_from_db()
    assert (attempt.state, attempt.error) == (AttemptState.CANCELLED, "cancelled by request")
    assert attempt.finished_at is not None
    assert Run.objects.get(id=run.id).state == RunState.CANCELLED
    assert AuditEvent.objects.get(run=run, action="run.cancelled").data == {
        "from_state": RunState.RUNNING
    }
    before = snapshot(run.id)

    assert attempt_succeed(attempt=attempt, now=later(5), result={"late": True}) is False
    keeper = LeaseKeeper(attempt, LEASE)
    assert keeper.renew() is False
    assert keeper.lost.is_set()
    ctx = RunContext(
        run_id=str(run.id),
        job_id=str(run.job_id),
        attempt=attempt.number,
        idempotency_key=run.idempotency_key,
        fencing_token=attempt.fencing_token,
        scheduled_for=run.scheduled_for,
        payload_ref=None,
        logger=logging.LoggerAdapter(logging.getLogger("tests"), {}),
        _attempt=attempt,
        _keeper=keeper,
    )
    assert ctx.cancel_requested is True
    with pytest.raises(StaleAttempt), ctx.effect("charge"):
        pytest.fail("the effect's body ran for a cancelled run")

    assert snapshot(run.id) == before
    assert not Effect.objects.exists()
    # A cancel is not staleness: the refused heartbeat is not counted.
    assert counter("scheduler_stale_completions_total", 'kind="heartbeat"') == 0


@pytest.mark.django_db(transaction=True)
def test_cancel_while_the_handler_runs_stops_it_at_its_next_heartbeat(api, queued_run):
    run = queued_run()
    publish(run)
    started = threading.Event()
    seen: list[str] = []
    outcome: list[dict] = []

    def handler(ctx):
        started.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ctx.heartbeat()
            if ctx.cancel_requested:
                seen.append("cancel")
                return {"stopped": True}
            time.sleep(0.02)
        seen.append("never cancelled")
        return {"stopped": False}

    def work() -> None:
        try:
            outcome.append(
                run_execute_delivery(
                    run_id=str(run.id), handler=handler, worker="w", message_id="m"
                )
            )
        finally:
            connection.close()

    worker = threading.Thread(target=work)
    worker.start()
    try:
        assert started.wait(timeout=10)
        response = cancel(api, run)
        assert response.status_code == 200, response.content
    finally:
        worker.join(timeout=20)
    assert not worker.is_alive()

    assert seen == ["cancel"]
    assert outcome == [{"run_id": str(run.id), "attempt": 1, "outcome": "stale"}]
    run.refresh_from_db()
    assert (run.state, run.result) == (RunState.CANCELLED, None)
    assert run.attempts.get().state == AttemptState.CANCELLED
    assert counter("scheduler_stale_completions_total", 'kind="heartbeat"') == 0


def _succeeded(run: Run) -> None:
    assert attempt_succeed(attempt=claim(run), now=later(1))


def _failed(run: Run) -> None:
    assert attempt_fail(attempt=claim(run), now=later(1), error="boom", retry_at=None)


def _skipped(run: Run) -> None:
    Run.objects.filter(id=run.id).update(state=RunState.SKIPPED, finished_at=later(1))


@pytest.mark.parametrize(
    ("finish", "state"),
    [
        (_succeeded, RunState.SUCCEEDED),
        (_failed, RunState.FAILED),
        (_skipped, RunState.SKIPPED),
    ],
    ids=["succeeded", "failed", "skipped"],
)
def test_cancel_of_a_finished_run_is_a_conflict_and_changes_nothing(api, queued_run, finish, state):
    run = queued_run()
    publish(run)
    finish(run)
    before = snapshot(run.id)

    response = cancel(api, run)

    assert response.status_code == 409
    body = response.json()
    assert body["state"] == state
    assert state in body["detail"]
    assert snapshot(run.id) == before
    assert not AuditEvent.objects.filter(run=run).exists()


# --- replay ----------------------------------------------------------------------------


def test_replay_of_a_failed_run_queues_the_same_run_for_the_next_attempt(api, user, queued_run):
    run = queued_run(retry={"max_attempts": 2, "initial_delay_seconds": 0, "jitter": False})
    publish(run)

    def boom(ctx):
        raise RuntimeError("boom")

    run_execute_delivery(run_id=str(run.id), handler=boom, worker="w", message_id="m1")
    assert scheduler_run_once(now=later(86400), config=SchedulerConfig()).retries_queued == 1
    publish(run)
    run_execute_delivery(run_id=str(run.id), handler=boom, worker="w", message_id="m2")
    run.refresh_from_db()
    assert (run.state, run.failure_reason, run.attempt_count) == (RunState.FAILED, "exhausted", 2)
    key = run.idempotency_key

    response = replay(api, run)

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["state"], body["failure_reason"], body["idempotency_key"]) == (
        RunState.QUEUED,
        "",
        key,
    )
    run.refresh_from_db()
    assert (run.state, run.failure_reason, run.idempotency_key) == (RunState.QUEUED, "", key)
    assert (run.finished_at, run.retry_base) == (None, 2)
    assert OutboxMessage.objects.filter(run=run, state=OutboxState.PENDING).count() == 1
    assert OutboxMessage.objects.filter(run=run).count() == 3
    event = AuditEvent.objects.get(run=run, action="run.replayed")
    assert (event.actor, event.data) == (
        user,
        {"from_state": "failed", "failure_reason": "exhausted", "attempts_before": 2},
    )

    third = claim(run, at=later(86400 * 2))
    assert (third.number, third.fencing_token) == (3, 3)
    assert Run.objects.get(id=run.id).state == RunState.RUNNING


def _running(run: Run) -> None:
    claim(run)


@pytest.mark.parametrize(
    ("prepare", "state"),
    [
        (lambda run: None, RunState.QUEUED),
        (_running, RunState.RUNNING),
        (_succeeded, RunState.SUCCEEDED),
    ],
    ids=["queued", "running", "succeeded"],
)
def test_replay_of_a_run_that_did_not_fail_is_a_conflict_and_changes_nothing(
    api, queued_run, prepare, state
):
    run = queued_run()
    prepare(run)
    before = snapshot(run.id)

    response = replay(api, run)

    assert response.status_code == 409
    assert response.json()["state"] == state
    assert state in response.json()["detail"]
    assert snapshot(run.id) == before
    assert not AuditEvent.objects.filter(run=run).exists()


@pytest.mark.parametrize("action", [cancel, replay], ids=["cancel", "replay"])
def test_another_owners_run_is_not_found_and_unchanged(api, other_user, queued_run, action):
    run = queued_run(owner=other_user)
    _failed(run)  # replayable, so only ownership can refuse it
    before = snapshot(run.id)

    assert action(api, run).status_code == 404
    assert snapshot(run.id) == before
    assert not AuditEvent.objects.filter(run=run).exists()


@pytest.mark.parametrize("action", [cancel, replay], ids=["cancel", "replay"])
def test_an_unauthenticated_request_is_refused(queued_run, action):
    run = queued_run()
    _failed(run)
    before = snapshot(run.id)

    assert action(APIClient(), run).status_code == 401
    assert snapshot(run.id) == before


# --- job cancel ------------------------------------------------------------------------


def test_job_cancel_cancels_the_job_and_every_active_run(api, user, make_job):
    job = make_job(now=NOW, schedule={"kind": "interval", "every_seconds": 300})
    assert scheduler_run_once(now=NOW, config=SchedulerConfig()).runs_created == 1
    waiting = Run.objects.get(job=job)
    publish(waiting)
    assert attempt_fail(attempt=claim(waiting), now=later(1), error="boom", retry_at=later(600))
    assert scheduler_run_once(now=later(300), config=SchedulerConfig()).runs_created == 1
    queued = Run.objects.get(job=job, state=RunState.QUEUED)
    job.refresh_from_db()
    assert job.next_run_at == later(600)

    response = api.post(f"/api/v1/jobs/{job.id}/cancel/")

    assert response.status_code == 200, response.content
    assert (response.json()["state"], response.json()["next_run_at"]) == (JobState.CANCELLED, None)
    job.refresh_from_db()
    assert (job.state, job.next_run_at) == (JobState.CANCELLED, None)
    waiting.refresh_from_db()
    queued.refresh_from_db()
    assert (waiting.state, waiting.next_attempt_at) == (RunState.CANCELLED, None)
    assert queued.state == RunState.CANCELLED
    assert not OutboxMessage.objects.filter(run=queued).exists()
    assert AuditEvent.objects.filter(job=job, action="job.cancelled", actor=user).count() == 1
    assert set(
        AuditEvent.objects.filter(action="run.cancelled").values_list("run_id", flat=True)
    ) == {waiting.id, queued.id}
    # No more runs: neither the schedule nor the retry brings one.
    scheduler_run_once(now=later(3600), config=SchedulerConfig())
    assert Run.objects.filter(job=job).exclude(state=RunState.CANCELLED).count() == 0
    audit_count = AuditEvent.objects.count()

    again = api.post(f"/api/v1/jobs/{job.id}/cancel/")

    assert again.status_code == 409
    assert again.json()["state"] == JobState.CANCELLED
    assert AuditEvent.objects.count() == audit_count
    assert Job.objects.get(id=job.id).state == JobState.CANCELLED


# --- handler outcomes without a retry --------------------------------------------------


def test_a_non_retryable_error_fails_the_run_after_one_attempt(queued_run):
    run = queued_run(retry={"max_attempts": 3, "initial_delay_seconds": 0, "jitter": False})

    def handler(ctx):
        raise NonRetryableError("bad input")

    result = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")

    assert result["outcome"] == RunState.FAILED
    run.refresh_from_db()
    assert (run.state, run.failure_reason, run.next_attempt_at) == (
        RunState.FAILED,
        "error",
        None,
    )
    attempt = run.attempts.get()
    assert attempt.state == AttemptState.FAILED and "bad input" in attempt.error
    assert scheduler_run_once(now=later(86400), config=SchedulerConfig()).retries_queued == 0


@pytest.mark.parametrize(
    ("overrides", "run_state", "reason"),
    [
        ({"retry": {"max_attempts": 1}}, RunState.FAILED, "timeout"),
        ({"retry": {"max_attempts": 2}}, RunState.RETRY_WAIT, ""),
        ({"retry": {"max_attempts": 2}, "delivery": "at_most_once"}, RunState.FAILED, (
            "outcome_unknown"
        )),
    ],
    ids=["no-attempt-left", "retries", "at-most-once"],
)  # fmt: skip
def test_the_soft_time_limit_times_the_attempt_out(queued_run, overrides, run_state, reason):
    run = queued_run(**overrides)

    def handler(ctx):
        raise SoftTimeLimitExceeded()

    result = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")

    assert result["outcome"] == run_state
    run.refresh_from_db()
    assert (run.state, run.failure_reason) == (run_state, reason)
    assert run.attempts.get().state == AttemptState.TIMED_OUT
    assert AuditEvent.objects.filter(run=run, action="attempt.timed_out").count() == 1


def test_a_cancel_just_before_the_claim_is_not_counted_as_a_duplicate_delivery(
    queued_run, user, monkeypatch
):
    import dispatch.runtime
    from jobs.services import run_cancel_request

    run = queued_run()
    publish(run)
    real_claim = dispatch.runtime.run_claim

    def cancelled_meanwhile(**kwargs):
        # The operator's cancel commits while the worker is between its read and its claim.
        assert run_cancel_request(run=Run.objects.get(id=run.id), actor=user, now=later(1))
        return real_claim(**kwargs)

    monkeypatch.setattr(dispatch.runtime, "run_claim", cancelled_meanwhile)

    assert_worker_refuses_cancelled(run)


def test_run_detail_shows_the_runs_history_with_its_actors(api, queued_run, user):
    run = queued_run()
    publish(run)
    assert api.post(f"/api/v1/runs/{run.id}/cancel/").status_code == 200
    assert api.post(f"/api/v1/runs/{run.id}/replay/").status_code == 200

    history = api.get(f"/api/v1/runs/{run.id}/").json()["history"]
    assert [(e["action"], e["actor"]) for e in history] == [
        ("run.cancelled", f"user:{user.username}"),
        ("run.replayed", f"user:{user.username}"),
    ]
    assert history[1]["data"]["from_state"] == "cancelled"
