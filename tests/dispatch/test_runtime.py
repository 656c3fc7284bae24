"""The worker runtime in process: claim, duplicate refusal, fencing, the effect ledger;
what it does with a run cancelled or replayed through the API (refuses it, stops its
handler, or runs it again under the next fencing token); and the handler outcomes that end
a run without a retry (NonRetryableError, the soft time limit)."""

import datetime as dt
import logging
import threading
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection

from dispatch import NonRetryableError, StaleAttempt
from dispatch.reaper import ReaperConfig, reaper_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from dispatch.worker import Lease, RunContext, run_execute_delivery
from jobs.clock import db_now
from jobs.models import (
    Attempt,
    AttemptState,
    AuditEvent,
    Counter,
    Effect,
    OutboxMessage,
    OutboxState,
    Run,
    RunState,
)
from jobs.transitions import attempt_succeed
from logs_app import capture as capture_mod
from tests.factories import CLAIM_LEASE_SECONDS as LEASE
from tests.factories import PINNED_NOW, claim, later, publish
from tests.factories import api_run_cancel as cancel
from tests.factories import api_run_replay as replay
from tests.factories import run_snapshot as snapshot

NOW = PINNED_NOW  # the clock of conftest's queued_run


def _counter(name: str) -> int:
    return sum(Counter.objects.filter(name=name).values_list("value", flat=True))


def test_a_second_delivery_of_a_claimed_run_is_refused_and_counted(queued_run):
    run = queued_run()
    calls = []
    first = run_execute_delivery(
        run_id=str(run.id),
        handler=lambda ctx: calls.append(ctx.attempt),
        worker="w1",
        message_id="m",
    )
    second = run_execute_delivery(
        run_id=str(run.id),
        handler=lambda ctx: calls.append(ctx.attempt),
        worker="w2",
        message_id="m",
    )
    assert first["outcome"] == "succeeded" and second["outcome"] == "refused"
    assert calls == [1]
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED and run.duplicate_deliveries == 1
    assert _counter("scheduler_duplicate_deliveries_total") == 1
    assert AuditEvent.objects.filter(run=run, action="run.duplicate_delivery_refused").count() == 1


def test_the_claim_records_the_publication_time_the_message_carries(queued_run):
    run = queued_run()
    sent = "2030-01-01T12:00:00.250000+00:00"  # what dispatch.relay puts in the kwargs

    outcome = run_execute_delivery(
        run_id=str(run.id), handler=lambda ctx: None, worker="w", message_id="m", published_at=sent
    )

    assert outcome["outcome"] == "succeeded"
    assert Run.objects.get(id=run.id).published_at == dt.datetime.fromisoformat(sent)


# Transactional: ctx.heartbeat() renews from the lease keeper's own connection.
@pytest.mark.django_db(transaction=True)
def test_handler_context_carries_the_run_identity(queued_run):
    run = queued_run(args=[1], kwargs={"b": 2})
    seen = {}

    def handler(ctx, a, b):
        seen.update(
            run_id=ctx.run_id,
            key=ctx.idempotency_key,
            attempt=ctx.attempt,
            token=ctx.fencing_token,
            scheduled_for=ctx.scheduled_for,
            a=a,
            b=b,
            alive=ctx.heartbeat(),
            cancel=ctx.cancel_requested,
        )

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    assert seen == {
        "run_id": str(run.id),
        "key": run.idempotency_key,
        "attempt": 1,
        "token": 1,
        "scheduled_for": NOW,
        "a": 1,
        "b": 2,
        "alive": True,
        "cancel": False,
    }


def test_an_effect_is_committed_once_and_seen_by_the_next_attempt(queued_run):
    run = queued_run(retry={"max_attempts": 2, "initial_delay_seconds": 0, "jitter": False})
    seen = []

    def handler(ctx):
        with ctx.effect("charge") as effect:
            seen.append(effect.done)
        if ctx.attempt == 1:
            raise RuntimeError("crash after the effect")

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m1")
    assert Run.objects.get(id=run.id).state == RunState.RETRY_WAIT
    scheduler_run_once(now=NOW + dt.timedelta(days=1), config=SchedulerConfig())
    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m2")
    assert seen == [False, True]
    assert Effect.objects.filter(run=run).count() == 1
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED


# Transactional: ctx.heartbeat() renews from the lease keeper's own connection.
@pytest.mark.django_db(transaction=True)
def test_a_superseded_attempt_can_neither_record_an_effect_nor_complete(queued_run):
    run = queued_run()
    outcomes = []

    def handler(ctx):
        # Another attempt took the run over, as after a lease expiry: the reaper ended this
        # attempt, and a new claim moved the token on.
        Attempt.objects.filter(run_id=ctx.run_id).update(state=AttemptState.LOST)
        Run.objects.filter(id=ctx.run_id).update(fencing_token=ctx.fencing_token + 1)
        try:
            with ctx.effect("charge"):
                outcomes.append("effect applied")
        except StaleAttempt:
            outcomes.append("effect refused")
        outcomes.append(("heartbeat", ctx.heartbeat(), ctx.cancel_requested))

    result = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    assert outcomes == ["effect refused", ("heartbeat", False, True)]
    assert result["outcome"] == "stale"
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and not Effect.objects.exists()
    assert _counter("scheduler_stale_completions_total") == 3  # effect, heartbeat, completion


@pytest.mark.parametrize(
    ("returned", "stored"),
    [
        ({"r": float("nan")}, "{'r': nan}"),
        ({"t": "a\x00b", "k\x00": ["c\x00"]}, {"t": "ab", "k": ["c"]}),
        ({"big": "x" * 70_000}, None),
    ],
    ids=["nan", "nul", "oversize"],
)
def test_any_return_value_is_stored_and_the_run_succeeds(queued_run, returned, stored):
    """PostgreSQL's jsonb refuses NaN and NUL: the outcome must still be recorded."""
    run = queued_run()
    result = run_execute_delivery(
        run_id=str(run.id), handler=lambda ctx: returned, worker="w", message_id="m"
    )
    assert result["outcome"] == "succeeded"
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED
    if stored is None:
        assert run.result["truncated"] is True
    else:
        assert run.result == stored


def test_an_error_message_with_nul_characters_is_stored(queued_run):
    run = queued_run(retry={"max_attempts": 1})

    def handler(ctx):
        raise ValueError("bad \x00 value")

    assert (
        run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")[
            "outcome"
        ]
        == "failed"
    )
    attempt = run.attempts.get()
    assert attempt.state == "failed" and "bad  value" in attempt.error
    assert Run.objects.get(id=run.id).failure_reason == "exhausted"


# --- a run cancelled or replayed through the API ---------------------------------------


def counter(name: str, labels: str = "") -> int:
    return sum(Counter.objects.filter(name=name, labels=labels).values_list("value", flat=True))


class Handler:
    """Records its calls; never expected to be called where the run was refused."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, ctx):
        self.calls.append(ctx.attempt)
        return {"ran": True}


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


def test_cancel_of_a_published_queued_run_and_the_worker_refuses_its_message(api, queued_run):
    run = queued_run()
    publish(run)

    response = cancel(api, run)

    assert response.status_code == 200, response.content
    assert Run.objects.get(id=run.id).state == RunState.CANCELLED
    assert not OutboxMessage.objects.filter(run=run).exists()  # the relay deleted it when sent
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
    keeper = Lease(attempt, LEASE)
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
        _lease=keeper,
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


def test_a_cancel_just_before_the_claim_is_not_counted_as_a_duplicate_delivery(
    queued_run, user, monkeypatch
):
    import dispatch.worker.delivery
    from jobs.services import run_cancel_request

    run = queued_run()
    publish(run)
    real_claim = dispatch.worker.delivery.run_claim

    cancels = []

    def cancelled_meanwhile(**kwargs):
        # The operator's cancel commits while the worker is between its read and its claim
        # (once: a refused one-statement claim is tried again behind the queue's gate).
        if not cancels:
            cancels.append(run_cancel_request(run=Run.objects.get(id=run.id), actor=user,
                                              now=later(1)))  # fmt: skip
        return real_claim(**kwargs)

    monkeypatch.setattr(dispatch.worker.delivery, "run_claim", cancelled_meanwhile)

    assert_worker_refuses_cancelled(run)
    assert cancels == [True]


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
    assert OutboxMessage.objects.filter(run=run).count() == 1  # the sent rows were deleted
    event = AuditEvent.objects.get(run=run, action="run.replayed")
    assert (event.actor, event.data) == (
        user,
        {"from_state": "failed", "failure_reason": "exhausted", "attempts_before": 2},
    )

    third = claim(run, at=later(86400 * 2))
    assert (third.number, third.fencing_token) == (3, 3)
    assert Run.objects.get(id=run.id).state == RunState.RUNNING


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


# --- the runtime beside the log shipper: effects, heartbeats, the lease ----------------


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_inside_a_long_effect_does_not_deadlock_with_the_shipper(queued_run):
    run = queued_run()
    events = []

    def handler(ctx):
        with ctx.effect("charge"):
            # The run row is locked FOR UPDATE for the effect. The shipper, ~1 s later, locks
            # the attempt row FOR UPDATE and inserts a LogChunk, whose FK check needs
            # FOR KEY SHARE on the run row: it waits, holding the attempt row.
            ctx.logger.info("charging")
            time.sleep(2.5)  # long effect body (a payment call...)
            t = time.monotonic()
            ok = ctx.heartbeat()  # UPDATE attempt -> waits for the shipper -> cycle
            events.append(("heartbeat", ok, round(time.monotonic() - t, 1)))
        return "ok"

    out = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, (
        out,
        events,
        run.state,
        run.attempts.first().error[-600:],
    )


@pytest.mark.django_db(transaction=True)
def test_the_same_handler_without_capture_succeeds_too(queued_run, settings):
    settings.SCHEDULER_LOGS = {**settings.SCHEDULER_LOGS, "capture": False}
    run = queued_run()

    def handler(ctx):
        with ctx.effect("charge"):
            ctx.logger.info("charging")
            time.sleep(2.5)
            ctx.heartbeat()
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_the_lease_is_kept_while_the_logs_are_finished(queued_run, monkeypatch):
    run = queued_run(heartbeat_timeout_seconds=2)
    real = capture_mod.chunk_ship

    def slow_connect(**kw):
        time.sleep(6)  # a slow connection to the database (pool exhausted, network)
        return real(**kw)

    monkeypatch.setattr(capture_mod, "chunk_ship", slow_connect)

    def reaper():
        time.sleep(4.5)
        try:
            reaper_run_once(now=db_now(), config=ReaperConfig())
        finally:
            connection.close()

    def handler(ctx):
        print("done")
        time.sleep(1.2)  # the shipper is now in chunk_ship
        threading.Thread(target=reaper).start()
        return "ok"

    out = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, (out, run.state)


def test_a_delivery_whose_claim_failed_is_delivered_again(queued_run, monkeypatch):
    """The message was acknowledged before the claim: when the database stays away past the
    claim's retries, the task publishes itself again instead of dropping the run."""
    from django.db import OperationalError

    import dispatch.worker.delivery
    import dispatch.worker.outage
    from tests.sample_tasks import record

    run = queued_run(task="tests.record")
    real_claim = dispatch.worker.delivery.run_claim
    calls = []

    def away_once(**kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("connection refused")
        return real_claim(**kwargs)

    monkeypatch.setattr(dispatch.worker.delivery, "run_claim", away_once)
    monkeypatch.setattr(dispatch.worker.outage, "COMPLETION_RETRY_SECONDS", 0.0)

    # Eagerly applied, Celery's retry runs the task again at once, as a worker would on
    # the message the retry publishes.
    result = record.apply(kwargs={"run_id": str(run.id)})

    assert len(calls) == 2
    assert result.get(propagate=False)["outcome"] == "succeeded"
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED


def test_runs_packed_in_one_message_each_get_their_own_attempt_and_outcome(queued_run):
    first, second, done = queued_run(), queued_run(), queued_run()
    from tests.sample_tasks import record

    record.apply(kwargs={"run_id": str(done.id)})  # already succeeded: a duplicate below

    result = record.apply(
        kwargs={"run_ids": [str(first.id), str(done.id), str(second.id)], "timeout_seconds": 60}
    ).get()

    assert [run["outcome"] for run in result["runs"]] == ["succeeded", "refused", "succeeded"]
    for run in (first, second):
        run.refresh_from_db()
        attempt = run.attempts.get()
        assert (run.state, attempt.fencing_token, attempt.state) == (
            RunState.SUCCEEDED, 1, AttemptState.SUCCEEDED
        )  # fmt: skip
    done.refresh_from_db()
    assert (done.duplicate_deliveries, done.attempts.count()) == (1, 1)


def test_a_packed_run_past_its_time_limit_times_out_alone(queued_run):
    from tests.sample_tasks import sleep

    slow = queued_run(task="tests.sleep", kwargs={"seconds": 5}, retry={"max_attempts": 1})
    fast = queued_run(task="tests.sleep", kwargs={"seconds": 0.1})

    result = sleep.apply(
        kwargs={"run_ids": [str(slow.id), str(fast.id)], "timeout_seconds": 0.5}
    ).get()

    assert [run["outcome"] for run in result["runs"]] == [RunState.FAILED, RunState.SUCCEEDED]
    assert slow.attempts.get().state == AttemptState.TIMED_OUT
    assert Run.objects.get(id=fast.id).state == RunState.SUCCEEDED


def test_a_packs_runs_are_reserved_together_and_each_starts_at_its_turn(queued_run):
    """One statement reserves the pack's first attempts: `running`, leased, no start; each
    records its own start with its outcome."""
    from dispatch.worker import run_execute_deliveries

    runs = [queued_run(timeout_seconds=60) for _ in range(3)]
    seen = {}

    def handler(ctx, *args, **kwargs):
        # While the first runs, the others are reserved and not started.
        attempts = Attempt.objects.filter(run_id__in=[run.id for run in runs]).order_by("id")
        seen[ctx.run_id] = [(a.state, a.started_at is None) for a in attempts]
        return "ok"

    summary = run_execute_deliveries(
        run_ids=[str(run.id) for run in runs], handler=handler, worker="w", message_id="m"
    )

    assert [item["outcome"] for item in summary["runs"]] == [RunState.SUCCEEDED] * 3
    first = seen[str(runs[0].id)]
    assert first == [(AttemptState.RUNNING, True)] * 3, first
    for run in runs:
        run.refresh_from_db()
        attempt = run.attempts.get()
        assert attempt.started_at is not None and attempt.started_at <= attempt.finished_at
        assert run.started_at == attempt.started_at
        assert attempt.claim_id is not None
    assert len({run.attempts.get().claim_id for run in runs}) == 1


def test_a_retry_an_at_most_once_run_and_a_duplicate_are_claimed_at_their_turn(queued_run):
    """Only first attempts of at_least_once runs are reserved: the others are claimed when
    their turn comes, so an attempt that may have started is always known to have."""
    from dispatch.worker import run_execute_deliveries

    fresh = queued_run()
    retry = queued_run()
    Run.objects.filter(id=retry.id).update(attempt_count=1, fencing_token=1)
    once = queued_run(delivery="at_most_once")
    started = {}

    def handler(ctx, *args, **kwargs):
        attempt = Attempt.objects.get(run_id=ctx.run_id, state=AttemptState.RUNNING)
        started[ctx.run_id] = attempt.started_at is not None

    summary = run_execute_deliveries(
        run_ids=[str(retry.id), str(once.id), str(fresh.id)], handler=handler, worker="w",
        message_id="m",
    )  # fmt: skip

    assert [item["outcome"] for item in summary["runs"]] == [RunState.SUCCEEDED] * 3
    assert started == {str(fresh.id): False, str(retry.id): True, str(once.id): True}
    assert Run.objects.get(id=retry.id).attempts.get().number == 2


def test_a_pack_whose_reservation_failed_is_delivered_again(queued_run, monkeypatch):
    from django.db import OperationalError

    import dispatch.worker.delivery
    import dispatch.worker.outage
    import dispatch.worker.packs
    from tests.sample_tasks import record

    runs = [queued_run() for _ in range(3)]
    real_reserve = dispatch.worker.packs.runs_reserve
    calls = []

    def away_once(**kwargs):
        calls.append(kwargs["run_ids"])
        if len(calls) == 1:
            raise OperationalError("connection refused")
        return real_reserve(**kwargs)

    monkeypatch.setattr(dispatch.worker.packs, "runs_reserve", away_once)
    monkeypatch.setattr(dispatch.worker.outage, "COMPLETION_RETRY_SECONDS", 0.0)

    record.apply(kwargs={"run_ids": [str(run.id) for run in runs]})

    # The retry carried the whole pack; each ran once.
    assert calls == [[str(run.id) for run in runs]] * 2
    assert all(Run.objects.get(id=run.id).state == RunState.SUCCEEDED for run in runs)
    assert all(Run.objects.get(id=run.id).attempts.count() == 1 for run in runs)


def test_the_unreserved_runs_of_a_pack_not_yet_claimed_are_delivered_again(queued_run, monkeypatch):
    from django.db import OperationalError

    import dispatch.worker.delivery
    import dispatch.worker.outage
    from tests.sample_tasks import record

    runs = [queued_run() for _ in range(3)]
    # Retries: claimed at their turn.
    Run.objects.filter(id__in=[run.id for run in runs]).update(attempt_count=1, fencing_token=1)
    real_claim = dispatch.worker.delivery.run_claim
    claimed = []

    def away_at_the_second(**kwargs):
        claimed.append(kwargs["run_id"])
        if len(claimed) == 2:
            raise OperationalError("connection refused")
        return real_claim(**kwargs)

    monkeypatch.setattr(dispatch.worker.delivery, "run_claim", away_at_the_second)
    monkeypatch.setattr(dispatch.worker.outage, "COMPLETION_RETRY_SECONDS", 0.0)

    record.apply(kwargs={"run_ids": [str(run.id) for run in runs]})

    # The retry carried the second and third runs only; each ran once.
    ids = [str(run.id) for run in runs]
    assert claimed == [ids[0], ids[1], ids[1], ids[2]]
    assert all(Run.objects.get(id=run.id).state == RunState.SUCCEEDED for run in runs)
    assert all(Run.objects.get(id=run.id).attempts.count() == 1 for run in runs)


def test_a_pack_ended_by_its_first_run_releases_the_others_uncharged(queued_run, monkeypatch):
    import asyncio

    from dispatch.promoter import PromoterConfig, promoter_run_once
    from dispatch.worker import run_execute_deliveries, run_execute_delivery
    from jobs.models import AuditEvent

    runs = [queued_run(retry={"max_attempts": 1}) for _ in range(3)]

    def first_interrupts(ctx, *args, **kwargs):
        if ctx.run_id == str(runs[0].id):
            raise asyncio.CancelledError()  # a BaseException: it ends the task
        return {"ok": True}

    with pytest.raises(asyncio.CancelledError):
        run_execute_deliveries(
            run_ids=[str(run.id) for run in runs], handler=first_interrupts, worker="w",
            message_id="m",
        )  # fmt: skip

    assert runs[0].attempts.get().state == AttemptState.FAILED
    for run in runs[1:]:
        run.refresh_from_db()
        attempt = run.attempts.get()
        assert (attempt.state, attempt.started_at) == (AttemptState.LOST, None)
        # Not charged: the run's one attempt is still to come.
        assert (run.state, run.attempt_count, run.retry_base) == (RunState.RETRY_WAIT, 1, 1)
    assert AuditEvent.objects.filter(action="attempt.released").count() == 2
    # The promoter queues them through the outbox; delivered again, they run.
    promoter_run_once(now=later(1), config=PromoterConfig())
    for run in runs[1:]:
        assert Run.objects.get(id=run.id).state == RunState.QUEUED
        out = run_execute_delivery(
            run_id=str(run.id), handler=first_interrupts, worker="w", message_id="m2"
        )
        assert out["outcome"] == RunState.SUCCEEDED
        assert Run.objects.get(id=run.id).attempts.count() == 2


def test_a_packed_run_cancelled_while_it_waits_its_turn_never_runs(queued_run, user):
    from dispatch.worker import run_execute_deliveries
    from dispatch.worker.packs import RESERVED_CHECK_SECONDS
    from jobs.services import run_cancel_request

    first, waiting = queued_run(), queued_run()
    ran = []

    def handler(ctx, *args, **kwargs):
        ran.append(ctx.run_id)
        if ctx.run_id == str(first.id):  # the operator cancels the next run meanwhile
            assert run_cancel_request(run=Run.objects.get(id=waiting.id), actor=user, now=later(1))
            time.sleep(RESERVED_CHECK_SECONDS * 2)

    summary = run_execute_deliveries(
        run_ids=[str(first.id), str(waiting.id)], handler=handler, worker="w", message_id="m"
    )

    assert ran == [str(first.id)]
    assert [item["outcome"] for item in summary["runs"]] == [RunState.SUCCEEDED, "cancelled"]
    assert Run.objects.get(id=waiting.id).state == RunState.CANCELLED
    attempt = Attempt.objects.get(run_id=waiting.id)
    assert (attempt.state, attempt.started_at) == (AttemptState.CANCELLED, None)


@pytest.mark.django_db(transaction=True)
def test_a_packed_success_is_recorded_while_a_later_run_still_runs(queued_run):
    """The lease keeper writes a success that waited SUCCESS_BATCH_SECONDS: a long run late
    in a pack does not hold back the ones before it."""
    from dispatch.worker import run_execute_deliveries

    quick, slow = queued_run(), queued_run()
    seen = {}

    def handler(ctx, *args, **kwargs):
        if ctx.run_id != str(slow.id):
            return "quick"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = Run.objects.filter(id=quick.id).values_list("state", flat=True).get()
            if state == RunState.SUCCEEDED:
                seen["quick"] = time.monotonic()
                break
            time.sleep(0.02)
        return "slow"

    start = time.monotonic()
    summary = run_execute_deliveries(
        run_ids=[str(quick.id), str(slow.id)], handler=handler, worker="w", message_id="m"
    )

    assert "quick" in seen, "the quick run's success waited for the slow run"
    assert seen["quick"] - start < 2.0
    assert [item["outcome"] for item in summary["runs"]] == [RunState.SUCCEEDED] * 2
    assert Run.objects.get(id=quick.id).result == "quick"
    assert Run.objects.get(id=slow.id).result == "slow"


@pytest.mark.django_db(transaction=True)
def test_a_reserved_run_cancelled_just_before_its_turn_is_cancelled_as_a_running_run(
    queued_run, user
):
    """Within RESERVED_CHECK_SECONDS of its turn a cancel may not be seen before the start:
    the run is `running` to its canceller, and is stopped as a running run is: its
    heartbeat says so, its completion is refused, the run stays cancelled."""
    from dispatch.worker import run_execute_deliveries
    from jobs.services import run_cancel_request

    first, waiting = queued_run(), queued_run()
    beats = {}

    def handler(ctx, *args, **kwargs):
        if ctx.run_id == str(first.id):
            assert run_cancel_request(run=Run.objects.get(id=waiting.id), actor=user, now=later(1))
            return "first"
        beats[ctx.run_id] = (ctx.heartbeat(), ctx.cancel_requested)
        return "should not be recorded"

    summary = run_execute_deliveries(
        run_ids=[str(first.id), str(waiting.id)], handler=handler, worker="w", message_id="m"
    )

    outcomes = [item["outcome"] for item in summary["runs"]]
    assert outcomes[0] == RunState.SUCCEEDED
    if str(waiting.id) in beats:  # started within the window
        assert beats[str(waiting.id)] == (False, True)
        assert outcomes[1] == "stale"
    else:
        assert outcomes[1] == "cancelled"
    waiting.refresh_from_db()
    assert (waiting.state, waiting.result) == (RunState.CANCELLED, None)
    assert Attempt.objects.get(run_id=waiting.id).state == AttemptState.CANCELLED


def test_a_reserved_runs_failure_records_its_start_with_the_outcome(queued_run):
    from dispatch.worker import run_execute_deliveries

    first, second = queued_run(retry={"max_attempts": 1}), queued_run()

    def handler(ctx, *args, **kwargs):
        if ctx.run_id == str(first.id):
            raise ValueError("boom")

    run_execute_deliveries(
        run_ids=[str(first.id), str(second.id)], handler=handler, worker="w", message_id="m"
    )
    first.refresh_from_db()
    attempt = first.attempts.get()
    assert (first.state, attempt.state) == (RunState.FAILED, AttemptState.FAILED)
    assert attempt.started_at is not None and first.started_at == attempt.started_at
    assert attempt.started_at <= attempt.finished_at


def test_a_run_claimed_at_its_turn_after_a_failed_success_write_is_delivered_again(
    queued_run, monkeypatch
):
    """The pack's successes are written before a run is claimed at its turn; when the
    database refuses that write, the run and the ones after it are delivered again."""
    from django.db import OperationalError

    import dispatch.worker.recording
    from dispatch.worker import run_execute_deliveries

    fresh, retry = queued_run(), queued_run()
    Run.objects.filter(id=retry.id).update(attempt_count=1, fencing_token=1)
    real_write = dispatch.worker.recording.Successes.write
    calls = []

    def away_before_the_claim(self, *, retry: bool = True):
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("connection refused")
        return real_write(self, retry=retry)

    monkeypatch.setattr(dispatch.worker.recording.Successes, "write", away_before_the_claim)

    summary = run_execute_deliveries(
        run_ids=[str(fresh.id), str(retry.id)], handler=lambda ctx: None, worker="w",
        message_id="m",
    )  # fmt: skip

    assert (summary["outcome"], summary["remaining"]) == ("claim_failed", [str(retry.id)])
    assert Run.objects.get(id=retry.id).state == RunState.QUEUED
    assert Run.objects.get(id=fresh.id).state == RunState.SUCCEEDED  # written at the end


@pytest.mark.parametrize(("retries", "words"), [(1, "failed\n"), (3, "failed; a retry follows")])
def test_a_handler_that_raised_is_logged_failed_with_its_redacted_traceback(
    queued_run, caplog, retries, words
):
    run = queued_run(retry={"max_attempts": retries, "initial_delay_seconds": 60})

    def handler(ctx):
        raise RuntimeError("cannot connect with password=hunter2")

    with caplog.at_level(logging.INFO, logger="dispatch.worker"):
        run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith(f"run {run.id} attempt 1 of tests.record {words}")
    assert "Traceback (most recent call last)" in line and "RuntimeError" in line
    assert "hunter2" not in line
    assert not any("succeeded" in r.getMessage() for r in caplog.records)


def test_celery_says_a_job_task_was_handled_not_that_its_run_succeeded():
    import celery.app.trace

    import scheduler_project.celery  # noqa: F401 - sets the wording

    assert "succeeded" not in celery.app.trace.LOG_SUCCESS
    assert "handled" in celery.app.trace.LOG_SUCCESS
