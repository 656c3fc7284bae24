"""The worker runtime in process: claim, duplicate refusal, fencing, the effect ledger."""

import datetime as dt

import pytest

from dispatch.runtime import StaleAttempt, run_execute_delivery
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import Attempt, AttemptState, AuditEvent, Counter, Effect, Run, RunState
from tests.factories import PINNED_NOW

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
