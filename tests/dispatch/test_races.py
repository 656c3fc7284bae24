"""Races between a worker, the reaper, a cancel and reconciliation over the same rows, each
lined up with threads and row locks so that the interleaving happens every time."""

import asyncio
import datetime as dt
import threading
import time

import pytest
from django.db import transaction

import jobs.transitions as transitions
from dispatch.errors import StaleAttempt
from dispatch.reaper import OutageGrace, ReaperConfig, reaper_run_once
from dispatch.reconciler import ReconcileConfig, ReconcileWindow, reconcile_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from dispatch.worker import LEASE_KEEPER, RunContext, run_execute_delivery
from jobs.models import (
    Attempt,
    AttemptState,
    Counter,
    Effect,
    Run,
    RunState,
)
from jobs.services import run_cancel_request
from jobs.transitions import attempt_renew_lease, attempt_succeed, run_claim
from tests.factories import PINNED_NOW, publish
from tests.threads import in_thread, wait_for_lock_waiters

NOW = PINNED_NOW


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


@pytest.mark.django_db(transaction=True)
def test_a_cancel_and_a_completion_of_the_same_attempt_never_deadlock(
    queued_run, user, monkeypatch
):
    run = queued_run()
    attempt = run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=30)
    attempt_locked, go = threading.Event(), threading.Event()
    original = transitions._move_runs
    completer: list[int] = []

    def paused_after_the_attempt_update(*args, **kwargs):
        if threading.get_ident() in completer:
            attempt_locked.set()  # the completion holds the attempt row
            go.wait(timeout=5)
        return original(*args, **kwargs)

    monkeypatch.setattr(transitions, "_move_runs", paused_after_the_attempt_update)
    errors: list = []
    results: dict = {}

    def complete() -> None:
        completer.append(threading.get_ident())
        results["complete"] = attempt_succeed(attempt=attempt, now=later(1))

    completion = in_thread(complete, errors)
    assert attempt_locked.wait(5)
    cancel = in_thread(
        lambda: results.setdefault(
            "cancel", run_cancel_request(run=Run.objects.get(id=run.id), actor=user, now=later(1))
        ),
        errors,
    )
    time.sleep(0.5)  # the cancel now waits for the attempt row, holding nothing
    go.set()
    completion.join(15)
    cancel.join(15)

    assert errors == []
    # The completion locked first and won; the cancel found the run finished.
    assert results == {"complete": True, "cancel": False}
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_worker_stuck_inside_an_effect_neither_stalls_the_reaper_nor_commits_once_stale(
    queued_run,
):
    slow, dead = queued_run(), queued_run()
    held = run_claim(run_id=slow.id, worker="w", now=NOW, lease_seconds=30)
    run_claim(run_id=dead.id, worker="w2", now=later(1), lease_seconds=30)
    inside, release = threading.Event(), threading.Event()
    errors: list = []
    ran: list = []

    def handler_inside_its_effect() -> None:
        ctx = RunContext(
            run_id=str(slow.id), job_id=str(slow.job_id), attempt=held.number,
            idempotency_key=slow.idempotency_key, fencing_token=held.fencing_token,
            scheduled_for=slow.scheduled_for, payload_ref=None, logger=None,
            _attempt=held, _lease=None,
        )  # fmt: skip
        try:
            with ctx.effect("send-mail"):
                Counter.objects.create(name="written inside the effect", value=1)
                inside.set()
                release.wait(timeout=20)  # a slow SMTP call, or a frozen process
                ran.append(True)
        except StaleAttempt:
            ran.append("refused")

    handler = in_thread(handler_inside_its_effect, errors)
    assert inside.wait(5)
    started = time.monotonic()
    result = reaper_run_once(now=later(120), config=ReaperConfig(lock_timeout_seconds=0.5))
    waited = time.monotonic() - started
    release.set()
    handler.join(30)

    # The handler's code holds no lock on its run: the reaper ends both expired attempts
    # at once, and the stale block is refused at its end, its own writes rolled back.
    assert waited < 5
    assert result.lost == 2
    assert Run.objects.get(id=dead.id).state == RunState.RETRY_WAIT
    assert Run.objects.get(id=slow.id).state == RunState.RETRY_WAIT
    assert ran == [True, "refused"]
    assert not Effect.objects.filter(run_id=slow.id).exists()
    assert not Counter.objects.filter(name="written inside the effect").exists()
    assert errors == []


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_meeting_the_reaper_is_not_renewed_and_refused_once_it_commits(queued_run):
    """The renewal does not wait for the reaper's row lock: not renewed while the reaper
    holds it, refused once the reaper commits; the lease is never extended."""
    run = queued_run()
    attempt = run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=30)
    locked, commit = threading.Event(), threading.Event()
    errors: list = []

    def reaper_like() -> None:  # what _finish does: attempt first, then run, one transaction
        with transaction.atomic():
            Attempt.objects.filter(id=attempt.id, state="running").update(
                state="lost", finished_at=later(40)
            )
            Run.objects.filter(id=run.id, state="running").update(state="retry_wait")
            locked.set()
            commit.wait(5)

    reaper = in_thread(reaper_like, errors)
    assert locked.wait(5)
    try:
        assert attempt_renew_lease(attempt=attempt, now=later(41), lease_seconds=30) is False
    finally:
        commit.set()
        reaper.join(10)
    assert attempt_renew_lease(attempt=attempt, now=later(42), lease_seconds=30) is False

    attempt.refresh_from_db()
    assert errors == []
    assert attempt.state == AttemptState.LOST and attempt.heartbeat_at == NOW


@pytest.mark.django_db
def test_runs_waiting_out_their_backoff_never_starve_a_newly_lost_message(queued_run):
    waiting = []
    for _ in range(3):
        run = queued_run()
        publish(run, at=later(-3600))  # republished 6 times, the last an hour ago
        Run.objects.filter(id=run.id).update(republish_count=6)
        waiting.append(run)
    lost = queued_run()
    publish(lost, at=later(-600))

    result = reconcile_run_once(
        now=NOW,
        config=ReconcileConfig(batch_size=3),
        queue_depth=lambda queue: 0,
        window=ReconcileWindow(),
    )
    assert result.republished == 1
    assert Run.objects.get(id=lost.id).republish_count == 1
    assert all(Run.objects.get(id=run.id).republish_count == 6 for run in waiting)


@pytest.mark.django_db(transaction=True)
def test_a_handler_raising_a_base_exception_releases_its_lease(queued_run):
    run = queued_run(heartbeat_timeout_seconds=2, retry={"max_attempts": 1})

    def handler(ctx, *args, **kwargs):
        raise asyncio.CancelledError()  # a BaseException, as an asyncio handler may leak

    with pytest.raises(asyncio.CancelledError):
        run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    attempt = Attempt.objects.get(run=run)
    assert attempt.state == AttemptState.FAILED
    assert Run.objects.get(id=run.id).state == RunState.FAILED
    assert not LEASE_KEEPER.held()


def test_the_reaper_waits_out_a_grace_after_the_database_returns():
    clock = [100.0]
    grace = OutageGrace(5.0, clock=lambda: clock[0])
    assert not grace.ready()  # first contact starts the grace
    clock[0] += 4.9
    assert not grace.ready()
    clock[0] += 0.2
    assert grace.ready()
    grace.outage(OSError("database away"))
    clock[0] += 100
    assert not grace.ready()  # the grace starts again when it answers again
    clock[0] += 5
    assert grace.ready()


@pytest.mark.django_db
def test_an_expired_attempt_whose_run_moved_on_is_ended_alone(queued_run):
    run = queued_run()
    attempt = run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=30)
    # A hand edit moved the run on without ending its attempt.
    Run.objects.filter(id=run.id).update(state=RunState.RETRY_WAIT, next_attempt_at=later(999))

    first = reaper_run_once(now=later(60), config=ReaperConfig())
    again = reaper_run_once(now=later(61), config=ReaperConfig())

    attempt.refresh_from_db()
    assert attempt.state == AttemptState.LOST
    assert (first.lost, again.lost, again.batch_full) == (0, 0, False)
    run.refresh_from_db()
    assert (run.state, run.next_attempt_at) == (RunState.RETRY_WAIT, later(999))


@pytest.mark.django_db(transaction=True)
def test_a_claim_whose_commit_answer_was_lost_is_recognized_on_retry(queued_run, monkeypatch):
    from django.db import OperationalError

    import dispatch.worker.delivery as delivery
    import dispatch.worker.outage as outage
    from jobs.models import Counter

    run = queued_run()
    real_claim = delivery.run_claim
    failures = []

    def commits_then_loses_the_answer(**kwargs):
        attempt = real_claim(**kwargs)  # committed
        if not failures:
            failures.append(attempt)
            raise OperationalError("server closed the connection unexpectedly")
        return attempt

    monkeypatch.setattr(delivery, "run_claim", commits_then_loses_the_answer)
    monkeypatch.setattr(outage.time, "sleep", lambda seconds: None)
    calls = []
    result = run_execute_delivery(
        run_id=str(run.id), handler=lambda ctx: calls.append(ctx.attempt), worker="w",
        message_id="m",
    )  # fmt: skip

    assert failures and calls == [1]
    assert result["outcome"] == RunState.SUCCEEDED
    run.refresh_from_db()
    assert (run.state, run.attempt_count, run.duplicate_deliveries) == (RunState.SUCCEEDED, 1, 0)
    assert not Counter.objects.filter(name="scheduler_duplicate_deliveries_total").exists()


@pytest.mark.django_db(transaction=True)
def test_a_completion_whose_commit_answer_was_lost_is_not_counted_stale(queued_run, monkeypatch):
    from django.db import OperationalError

    import dispatch.worker.outage as outage
    import dispatch.worker.recording as recording
    from jobs.models import Counter

    run = queued_run()
    real_succeed = recording.attempts_record_success
    failures = []

    def commits_then_loses_the_answer(**kwargs):
        won = real_succeed(**kwargs)
        if not failures:
            failures.append(bool(won))
            raise_after_commit.append(True)  # lose the answer once its transaction commits
        return won

    raise_after_commit: list = []
    real_retries = recording.with_database_retries

    def flaky(write):
        def once():
            value = write()
            if raise_after_commit:
                raise_after_commit.clear()
                raise OperationalError("server closed the connection unexpectedly")
            return value

        return real_retries(once)

    monkeypatch.setattr(recording, "attempts_record_success", commits_then_loses_the_answer)
    monkeypatch.setattr(recording, "with_database_retries", flaky)
    monkeypatch.setattr(outage.time, "sleep", lambda seconds: None)
    result = run_execute_delivery(
        run_id=str(run.id), handler=lambda ctx: "done", worker="w", message_id="m"
    )

    assert failures == [True]
    assert result["outcome"] == RunState.SUCCEEDED
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED
    assert not Counter.objects.filter(name="scheduler_stale_completions_total").exists()


@pytest.mark.django_db(transaction=True)
def test_a_cancel_waiting_on_a_claim_in_flight_cancels_the_attempt_it_made(queued_run):
    from django.db import connections

    run = queued_run()
    result = {}

    def cancel():
        try:
            result["cancelled"] = run_cancel_request(run=run, actor=None, now=NOW)
        finally:
            connections.close_all()

    with transaction.atomic():
        attempt = run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=60)
        thread = threading.Thread(target=cancel)
        thread.start()
        wait_for_lock_waiters(1)  # the cancel saw no running attempt; it waits on the run row
    thread.join(30)
    run.refresh_from_db()
    attempt.refresh_from_db()
    assert result["cancelled"] and run.state == RunState.CANCELLED
    assert attempt.state == AttemptState.CANCELLED
    assert not attempt_renew_lease(attempt=attempt, now=NOW, lease_seconds=60)


@pytest.mark.django_db(transaction=True)
def test_a_final_failure_pausing_its_job_never_deadlocks_with_cancel_previous(make_job):
    from django.db import DatabaseError, connections

    from jobs.models import Job
    from jobs.outcomes import attempt_record_failure

    job = make_job(
        now=NOW,
        schedule={"kind": "interval", "every_seconds": 60},
        overlap="cancel_previous",
        pause_after_failures=1,
        retry={"max_attempts": 1},
    )
    scheduler_run_once(now=later(1), config=SchedulerConfig())
    run = Run.objects.get(job=job)
    attempt = run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=3600)
    errors = {}

    def worker():
        try:
            attempt_record_failure(attempt=attempt, spec=job.spec, retry_base=0, ended="failed",
                                   error="boom", now=later(61), by="worker")  # fmt: skip
        except DatabaseError as exc:
            errors["worker"] = exc
        finally:
            connections.close_all()

    try:
        with transaction.atomic():
            Job.objects.select_for_update().get(id=job.id)  # a scheduler pass holds the job
            thread = threading.Thread(target=worker)
            thread.start()
            wait_for_lock_waiters(1)  # the worker's pause (after its commit) waits on the job
            scheduler_run_once(now=later(61), config=SchedulerConfig())
    except DatabaseError as exc:
        errors["scheduler"] = exc
    thread.join(30)
    assert not errors, {k: repr(v)[:200] for k, v in errors.items()}
    assert Run.objects.get(id=run.id).state == RunState.FAILED
    assert Job.objects.get(id=job.id).state == "paused"


@pytest.mark.django_db(transaction=True)
def test_a_cancel_never_holds_a_run_claimed_meanwhile_while_it_waits_for_its_attempt(
    queued_run,
):
    """Cancelling runs of several jobs locks their running attempts and the runs not
    running. A claim that commits while the cancel waits on its run leaves that run locked
    all the same (PostgreSQL locks a row's new version before it finds it no longer
    matches): the cancel must not then wait for the new attempt, which a worker ending it
    holds while it waits for the run (the drill's deadlock, lined up here)."""
    from jobs.models import Attempt, Run, RunState

    busy = queued_run()
    busy_attempt = run_claim(run_id=busy.id, worker="w")  # running: attempt A0
    fresh = queued_run()  # queued: the claim below starts it while the cancel waits
    claiming, claimed, holding, release = (threading.Event() for _ in range(4))
    errors: list = []
    ended: list = []

    def hold_busy_attempt() -> None:  # another session holds A0 (a keeper's renewal, say)
        with transaction.atomic():
            list(Attempt.objects.select_for_update().filter(id=busy_attempt.id))
            holding.set()
            release.wait(20)

    def claim_fresh() -> None:  # a claim in flight on the queued run
        with transaction.atomic():
            ended.append(run_claim(run_id=fresh.id, worker="w"))
            claiming.set()
            claimed.wait(20)

    def cancel_both() -> None:
        with transaction.atomic():
            transitions.runs_lock_to_cancel(run_ids=[busy.id, fresh.id])

    def succeed_fresh() -> None:  # the worker ends the new attempt: attempt, then run
        with transaction.atomic():
            transitions.attempts_succeed(outcomes=[(ended[0], None)])

    threads = [in_thread(hold_busy_attempt, errors), in_thread(claim_fresh, errors)]
    try:
        assert holding.wait(10) and claiming.wait(10)
        threads.append(in_thread(cancel_both, errors))
        wait_for_lock_waiters(1)  # the cancel waits (on the run, or on A0)
        claimed.set()  # the claim commits: the run is running, with a new attempt
        threads[1].join(10)
        time.sleep(0.3)
        wait_for_lock_waiters(1)  # the cancel waits on A0
        threads.append(in_thread(succeed_fresh, errors))
        time.sleep(1.0)  # the worker's success runs, or waits on the run the cancel holds
    finally:
        release.set()
        claimed.set()
        for thread in threads:
            thread.join(20)
    assert errors == []
    assert Run.objects.get(id=fresh.id).state == RunState.SUCCEEDED
