"""The reaper in process (dispatch.reaper): expired leases end `lost`, overrun deadlines end
`timed_out`, each by the fenced transition a worker's own completion uses. Clocks are
pinned; two reapers race on the same rows in the one transactional test."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import connection, transaction

from dispatch.reaper import ReaperConfig, ReaperResult, reaper_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from dispatch.worker import Lease
from jobs.models import (
    Attempt,
    AttemptState,
    AuditEvent,
    Counter,
    OutboxMessage,
    OutboxState,
    Run,
    RunState,
)
from jobs.outcomes import attempt_record_failure
from jobs.services import run_replay_request
from jobs.transitions import attempt_renew_lease, attempt_succeed, run_claim
from tests.factories import CLAIM_LEASE_SECONDS as LEASE
from tests.factories import PINNED_NOW, claim
from tests.threads import in_thread, wait_for_lock_waiters

NOW = PINNED_NOW
CONFIG = ReaperConfig()
NO_JITTER = {"initial_delay_seconds": 10, "backoff_factor": 2.0, "jitter": False}


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


def counter(name: str, labels: str = "") -> int:
    return sum(Counter.objects.filter(name=name, labels=labels).values_list("value", flat=True))


def snapshot(run_id) -> tuple[dict, list[dict]]:
    """Everything the run and its attempts hold, to show that nothing changed."""
    return (
        Run.objects.filter(id=run_id).values().get(),
        list(Attempt.objects.filter(run_id=run_id).order_by("number").values()),
    )


# --- lost leases -----------------------------------------------------------------------


def test_an_expired_lease_is_lost_and_the_run_waits_for_its_retry(queued_run):
    run = queued_run(retry={"max_attempts": 3, **NO_JITTER})
    expired = claim(run, at=NOW)  # lease until NOW + 30
    live_run = queued_run()
    live = claim(live_run, at=later(20))  # lease until NOW + 50
    live_before = snapshot(live_run.id)

    # At the instant of expiry the lease still holds.
    assert reaper_run_once(now=later(LEASE), config=CONFIG) == ReaperResult(0, 0, False)
    assert Attempt.objects.get(id=expired.id).state == AttemptState.RUNNING

    result = reaper_run_once(now=later(31), config=CONFIG)

    assert result == ReaperResult(lost=1, timed_out=0, batch_full=False)
    expired.refresh_from_db()
    assert (expired.state, expired.finished_at) == (AttemptState.LOST, later(31))
    assert "lease expired" in expired.error
    run.refresh_from_db()
    assert (run.state, run.next_attempt_at) == (RunState.RETRY_WAIT, later(31 + 10))
    assert (run.finished_at, run.failure_reason, run.fencing_token) == (None, "", 1)
    assert counter("scheduler_lease_expired_total") == 1
    event = AuditEvent.objects.get(run=run, action="attempt.lost")
    assert event.actor_label == "system:reaper"
    assert event.data == {
        "attempt": 1,
        "fencing_token": 1,
        "retry_at": later(41).isoformat(),
        "failure_reason": "",
    }
    # The attempt whose lease is still valid is untouched.
    assert snapshot(live_run.id) == live_before
    assert not AuditEvent.objects.filter(run=live_run).exists()
    assert Attempt.objects.get(id=live.id).state == AttemptState.RUNNING


def test_a_lost_attempt_with_no_retry_left_fails_the_run_as_lost(queued_run):
    run = queued_run(retry={"max_attempts": 1})
    attempt = claim(run, at=NOW)

    assert reaper_run_once(now=later(31), config=CONFIG).lost == 1

    run.refresh_from_db()
    assert (run.state, run.failure_reason, run.finished_at) == (
        RunState.FAILED,
        "lost",
        later(31),
    )
    assert run.next_attempt_at is None
    assert Attempt.objects.get(id=attempt.id).state == AttemptState.LOST
    assert AuditEvent.objects.get(run=run, action="attempt.lost").data["failure_reason"] == "lost"
    assert counter("scheduler_lease_expired_total") == 1


def test_an_at_most_once_run_fails_with_an_unknown_outcome_even_with_attempts_left(queued_run):
    run = queued_run(delivery="at_most_once", retry={"max_attempts": 3})
    attempt = claim(run, at=NOW)

    assert reaper_run_once(now=later(31), config=CONFIG).lost == 1

    run.refresh_from_db()
    assert (run.state, run.failure_reason) == (RunState.FAILED, "outcome_unknown")
    assert run.next_attempt_at is None
    assert Attempt.objects.get(id=attempt.id).state == AttemptState.LOST
    # Nothing was re-queued for another attempt.
    assert scheduler_run_once(now=later(10_000), config=SchedulerConfig()).retries_queued == 0
    assert Run.objects.get(id=run.id).state == RunState.FAILED


# --- overrun deadlines -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_attempts", "run_state", "reason"),
    [(3, RunState.RETRY_WAIT, ""), (1, RunState.FAILED, "timeout")],
    ids=["retries", "no-attempt-left"],
)
def test_an_attempt_past_its_deadline_and_grace_times_out_while_its_lease_holds(
    queued_run, max_attempts, run_state, reason
):
    run = queued_run(retry={"max_attempts": max_attempts, **NO_JITTER})
    attempt = claim(run, at=NOW, timeout=10)  # deadline NOW + 10
    grace = CONFIG.deadline_grace_seconds
    # The worker keeps renewing: its lease outlives deadline + grace.
    assert attempt_renew_lease(attempt=attempt, now=later(25), lease_seconds=LEASE + grace)
    assert Attempt.objects.get(id=attempt.id).lease_expires_at > later(10 + grace + 1)

    # Past the deadline but within the grace the worker's own time limits get: untouched.
    assert reaper_run_once(now=later(10 + grace), config=CONFIG) == ReaperResult(0, 0, False)
    assert Attempt.objects.get(id=attempt.id).state == AttemptState.RUNNING

    result = reaper_run_once(now=later(10 + grace + 1), config=CONFIG)

    assert result == ReaperResult(lost=0, timed_out=1, batch_full=False)
    attempt.refresh_from_db()
    assert (attempt.state, attempt.finished_at) == (AttemptState.TIMED_OUT, later(11 + grace))
    assert "deadline" in attempt.error
    run.refresh_from_db()
    assert (run.state, run.failure_reason) == (run_state, reason)
    if run_state == RunState.RETRY_WAIT:
        assert run.next_attempt_at == later(11 + grace + 10)
    else:
        assert (run.next_attempt_at, run.finished_at) == (None, later(11 + grace))
    assert AuditEvent.objects.filter(run=run, action="attempt.timed_out").count() == 1
    # A timeout is not a lost lease.
    assert counter("scheduler_lease_expired_total") == 0


# --- the worker that comes back --------------------------------------------------------


def test_the_original_worker_is_refused_after_the_reaper_and_the_retry_takes_token_two(
    queued_run,
):
    run = queued_run(retry={"max_attempts": 3, **NO_JITTER})
    old = claim(run, at=NOW)
    assert reaper_run_once(now=later(31), config=CONFIG).lost == 1
    before = snapshot(run.id)

    assert attempt_succeed(attempt=old, now=later(32), result={"late": True}) is False
    assert attempt_renew_lease(attempt=old, now=later(32), lease_seconds=LEASE) is False
    assert (
        attempt_record_failure(
            attempt=old,
            spec=run.job_version.spec,
            retry_base=0,
            ended=AttemptState.FAILED,
            error="late",
            now=later(32),
            by="worker:worker-a",
        )
        is None
    )
    keeper = Lease(old, LEASE)
    assert keeper.renew() is False
    assert keeper.lost.is_set()
    assert snapshot(run.id) == before
    # Refused for staleness, not a cancel: counted.
    assert counter("scheduler_stale_completions_total", 'kind="heartbeat"') == 1

    # The retry promoter re-queues the run when due (not before), with a new outbox row.
    assert scheduler_run_once(now=later(40), config=SchedulerConfig()).retries_queued == 0
    assert scheduler_run_once(now=later(41), config=SchedulerConfig()).retries_queued == 1
    run.refresh_from_db()
    assert (run.state, run.next_attempt_at) == (RunState.QUEUED, None)
    assert OutboxMessage.objects.filter(run=run, state=OutboxState.PENDING).count() == 2

    second = run_claim(run_id=run.id, worker="worker-b", now=later(42), lease_seconds=LEASE)
    assert (second.number, second.fencing_token) == (2, 2)
    # The old attempt object is still refused; the new one completes the run.
    assert attempt_succeed(attempt=old, now=later(43)) is False
    assert attempt_succeed(attempt=second, now=later(44), result={"ok": True}) is True
    run.refresh_from_db()
    assert (run.state, run.result, run.fencing_token) == (RunState.SUCCEEDED, {"ok": True}, 2)
    assert Attempt.objects.get(id=old.id).state == AttemptState.LOST


# --- replicas --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_reapers_at_once_end_each_of_50_expired_attempts_exactly_once(make_job):
    count = 50
    for index in range(count):
        make_job(
            now=NOW - dt.timedelta(minutes=1),
            name=f"reaped {index}",
            schedule={"kind": "once", "run_at": NOW.isoformat()},
        )
    assert scheduler_run_once(now=NOW, config=SchedulerConfig()).runs_created == count
    for run in Run.objects.all():
        claim(run, at=NOW)

    barrier = threading.Barrier(2)
    totals: list[int] = []
    errors: list[BaseException] = []

    def reap() -> None:
        lost = 0
        try:
            barrier.wait(timeout=10)
            # Small batches, so the two replicas interleave over the same rows.
            config = ReaperConfig(batch_size=5)
            for _ in range(1000):
                lost += reaper_run_once(now=later(60), config=config).lost
                if not Attempt.objects.filter(state=AttemptState.RUNNING).exists():
                    break
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)
        finally:
            totals.append(lost)
            connection.close()

    threads = [threading.Thread(target=reap) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    assert errors == []
    assert sum(totals) == count
    assert counter("scheduler_lease_expired_total") == count
    assert Attempt.objects.filter(state=AttemptState.LOST).count() == count
    assert Attempt.objects.count() == count
    assert Run.objects.filter(state=RunState.RETRY_WAIT).count() == count
    assert AuditEvent.objects.filter(action="attempt.lost").count() == count
    assert AuditEvent.objects.filter(action="attempt.lost").values("run").distinct().count() == (
        count
    )


# --- operator replay -------------------------------------------------------------------


def test_a_replay_after_exhausting_grants_a_fresh_retry_budget(queued_run, user):
    run = queued_run(retry={"max_attempts": 2, **NO_JITTER})
    claim(run, at=NOW)
    assert reaper_run_once(now=later(31), config=CONFIG).lost == 1
    assert scheduler_run_once(now=later(41), config=SchedulerConfig()).retries_queued == 1
    claim(run, at=later(41))
    assert reaper_run_once(now=later(72), config=CONFIG).lost == 1
    run.refresh_from_db()
    assert (run.state, run.failure_reason, run.attempt_count) == (RunState.FAILED, "lost", 2)

    assert run_replay_request(run=run, actor=user, now=later(100)) is True

    run.refresh_from_db()
    assert (run.state, run.retry_base, run.failure_reason) == (RunState.QUEUED, 2, "")
    third = claim(run, at=later(100))
    assert (third.number, third.fencing_token) == (3, 3)
    assert reaper_run_once(now=later(131), config=CONFIG).lost == 1
    run.refresh_from_db()
    # Without the fresh budget, attempt 3 of max_attempts 2 would fail the run.
    assert (run.state, run.next_attempt_at) == (RunState.RETRY_WAIT, later(141))
    # ...and the fresh budget is max_attempts again, no more.
    assert scheduler_run_once(now=later(141), config=SchedulerConfig()).retries_queued == 1
    claim(run, at=later(141))
    assert reaper_run_once(now=later(172), config=CONFIG).lost == 1
    run.refresh_from_db()
    assert (run.state, run.failure_reason, run.attempt_count) == (RunState.FAILED, "lost", 4)


@pytest.mark.django_db(transaction=True)
def test_a_cancel_racing_the_reaper_never_deadlocks_and_both_outcomes_stand(queued_run, user):
    from jobs.services import run_cancel_request

    first, second = queued_run(), queued_run()
    claim(first, at=NOW)
    claim(second, at=later(1))  # the reaper's batch is ordered by lease expiry: first, second
    held, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold_first_run() -> None:
        # Only timing: keeps the reaper inside its batch, holding the second attempt's lock.
        try:
            with transaction.atomic():
                Run.objects.select_for_update().get(id=first.id)
                held.set()
                release.wait(timeout=10)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_first_run)
    holder.start()
    assert held.wait(timeout=10)
    reaper = in_thread(lambda: reaper_run_once(now=later(60), config=CONFIG), errors)
    wait_for_lock_waiters(1)  # the reaper waits for the first run's row
    canceller = in_thread(
        lambda: run_cancel_request(run=Run.objects.get(id=second.id), actor=user, now=later(61)),
        errors,
    )
    # The reaper holds no lock on the second attempt while it waits on the first: the cancel
    # finishes at once instead of deadlocking.
    canceller.join(timeout=10)
    assert not canceller.is_alive()
    release.set()
    for thread in (holder, reaper, canceller):
        thread.join(timeout=30)

    assert errors == []
    assert Run.objects.get(id=first.id).state == RunState.RETRY_WAIT
    assert Run.objects.get(id=second.id).state == RunState.CANCELLED


def _reserve_pack(queued_run, count: int):
    """A packed message's runs reserved by a worker that is then lost: their attempts are
    running with leases the reaper sees expired an hour later."""
    import uuid

    from jobs.clock import db_now
    from jobs.transitions import runs_reserve

    runs = [queued_run(retry={"max_attempts": 3}) for _ in range(count)]
    attempts = runs_reserve(run_ids=[run.id for run in runs], worker="w", claim_id=uuid.uuid4())
    assert [a.run_id for a in attempts] == [run.id for run in runs]
    return runs, attempts, db_now() + dt.timedelta(hours=1)


def _budget_used(run) -> int:
    run.refresh_from_db()
    return run.attempt_count - run.retry_base


@pytest.mark.parametrize("batch_size", [200, 1])
def test_a_lost_packs_first_reserved_attempt_is_charged_and_the_others_released(
    queued_run, batch_size
):
    """Its worker runs a pack's reserved attempts one at a time, in the order of their ids:
    only the first not yet recorded may have run, so only it is charged; the others never
    started, and go back to their queue with their budget untouched, however many reaper
    passes it takes."""
    runs, attempts, now = _reserve_pack(queued_run, 4)
    # The first succeeded, recorded; the worker was lost during the second.
    assert attempt_succeed(attempt=attempts[0])

    for _ in range(4):
        reaper_run_once(now=now, config=ReaperConfig(batch_size=batch_size))

    states = [Attempt.objects.get(id=a.id).state for a in attempts]
    assert states == [AttemptState.SUCCEEDED] + [AttemptState.LOST] * 3
    assert [_budget_used(run) for run in runs[1:]] == [1, 0, 0]
    assert all(Run.objects.get(id=run.id).state == RunState.RETRY_WAIT for run in runs[1:])
    released = Attempt.objects.filter(id__in=[a.id for a in attempts[2:]])
    assert all("not started" in attempt.error for attempt in released)
    # Released runs are due again at once; the charged one waits for its back-off.
    assert Run.objects.get(id=runs[2].id).next_attempt_at <= now
    assert (
        Run.objects.get(id=runs[1].id).next_attempt_at
        > Run.objects.get(id=runs[2].id).next_attempt_at
    )


def test_a_reserved_attempts_deadline_is_the_latest_it_can_end(queued_run):
    """A reserved run waits behind its pack-mates: its deadline leaves room for each of them
    and itself to run to its limit; past it (and the grace) the reaper times it out even
    while its lease holds, as it does a claimed attempt."""
    import uuid

    from jobs.clock import db_now
    from jobs.transitions import runs_reserve

    runs = [queued_run(timeout_seconds=10, retry={"max_attempts": 1}) for _ in range(3)]
    attempts = runs_reserve(
        run_ids=[run.id for run in runs], worker="w", claim_id=uuid.uuid4(), grace_seconds=5
    )
    reserved_at = attempts[0].reserved_at
    deadlines = [Attempt.objects.get(id=a.id).deadline_at - reserved_at for a in attempts]
    # Each run before it at its limit and grace (10 + 5 s), then its own limit.
    assert deadlines == [dt.timedelta(seconds=seconds) for seconds in (10, 25, 40)]
    # Leases renewed far ahead: only the deadline can end them.
    Attempt.objects.filter(id__in=[a.id for a in attempts]).update(
        lease_expires_at=db_now() + dt.timedelta(hours=1)
    )
    grace = dt.timedelta(seconds=ReaperConfig().deadline_grace_seconds)
    config = ReaperConfig()
    result = reaper_run_once(now=reserved_at + dt.timedelta(seconds=26) + grace, config=config)
    assert (result.lost, result.timed_out, result.released) == (0, 2, 0)
    states = [Attempt.objects.get(id=a.id).state for a in attempts]
    assert states == [AttemptState.TIMED_OUT] * 2 + [AttemptState.RUNNING]


def test_a_lost_packs_first_is_its_first_unrecorded_attempt_even_with_a_longer_lease(queued_run):
    """Pack-mates of different jobs may have different heartbeat timeouts: the later ones'
    leases lapse first, and are released; the first, once its lease lapses too, is charged."""
    runs, attempts, now = _reserve_pack(queued_run, 3)
    Attempt.objects.filter(id=attempts[0].id).update(lease_expires_at=now + dt.timedelta(hours=1))

    first = reaper_run_once(now=now, config=ReaperConfig())
    assert (first.lost, first.released) == (0, 2)
    assert [_budget_used(run) for run in runs] == [1, 0, 0]  # the first is still running
    assert Attempt.objects.get(id=attempts[0].id).state == AttemptState.RUNNING

    later_pass = reaper_run_once(now=now + dt.timedelta(hours=2), config=ReaperConfig())
    # Charged (lost, or timed out: two hours on, it is past its deadline too).
    assert (later_pass.lost + later_pass.timed_out, later_pass.released) == (1, 0)
    assert [_budget_used(run) for run in runs] == [1, 0, 0]
    assert Attempt.objects.get(id=attempts[0].id).state != AttemptState.RUNNING
