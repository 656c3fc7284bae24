"""Reconciliation in process (dispatch.reconciler): runs whose message was lost in the broker
(their queue is empty, or later messages of their queue were claimed) are published again,
then given up as undeliverable; running runs without a live attempt are repaired. The
broker's queue depth is a seam (`queue_depth`), faked here except in the one test that asks
the session's real RabbitMQ vhost."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import uuid

import pytest
from django.conf import settings
from kombu import Connection, Queue

from dispatch.reconciler import (
    BrokerQueueDepth,
    ReconcileConfig,
    ReconcileResult,
    ReconcileWindow,
    reconcile_run_once,
)
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
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
from jobs.services import run_replay_request
from jobs.transitions import run_claim, runs_stamp_published_late
from tests.factories import publish
from tests.factories import run_snapshot as snapshot

pytestmark = pytest.mark.django_db

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)
THRESHOLD = 300.0
CONFIG = ReconcileConfig(queued_after_seconds=THRESHOLD)


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


def empty_queue(queue: str) -> int:
    return 0


def counter(name: str, labels: str = "") -> int:
    return sum(Counter.objects.filter(name=name, labels=labels).values_list("value", flat=True))


@pytest.fixture
def queued_run(make_job, settings):
    """make(**job_overrides): a one-time job's run, queued by the scheduler at `created`,
    with its outbox row still pending (on a queue the test allows, as an operator would)."""

    def make(*, created: dt.datetime = NOW - dt.timedelta(hours=1), **overrides) -> Run:
        queue = overrides.get("queue")
        if queue and queue not in settings.SCHEDULER_QUEUES:
            settings.SCHEDULER_QUEUES = [*settings.SCHEDULER_QUEUES, queue]
        job = make_job(
            now=created - dt.timedelta(minutes=1),
            schedule={"kind": "once", "run_at": created.isoformat()},
            **overrides,
        )
        scheduler_run_once(now=created, config=SchedulerConfig())
        return Run.objects.select_related("job_version").get(job=job)

    return make


@pytest.fixture
def window() -> ReconcileWindow:
    """The reconciliation loop's walk over the queued runs, one per test as one per loop."""
    return ReconcileWindow()


# --- lost messages ---------------------------------------------------------------------


def test_a_run_published_long_ago_and_never_claimed_is_published_again(queued_run, window):
    lost = queued_run()
    first_message_id = OutboxMessage.objects.get(run=lost).message_id
    publish(lost, at=later(-THRESHOLD - 1))
    recent = queued_run()
    publish(recent, at=later(-THRESHOLD + 1))
    recent_before = snapshot(recent.id)
    asked = []

    def depth(queue: str) -> int:
        asked.append(queue)
        return 0

    result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=depth, window=window)

    assert result == ReconcileResult(republished=1)
    assert asked == ["jobs"]  # asked once per queue, not once per run
    lost.refresh_from_db()
    assert (lost.state, lost.republish_count) == (RunState.QUEUED, 1)
    fresh = OutboxMessage.objects.get(run=lost)
    assert (fresh.state, fresh.created_at, fresh.task_name, fresh.queue) == (
        OutboxState.PENDING,
        NOW,
        "tests.record",
        "jobs",
    )
    assert fresh.message_id != first_message_id
    event = AuditEvent.objects.get(run=lost, action="run.republished")
    assert (event.actor_label, event.job_id) == ("system:reconciler", lost.job_id)
    assert event.data == {
        "last_published_at": later(-THRESHOLD - 1).isoformat(),
        "republish": 1,
        "lost_because": "queue_idle",
    }
    assert counter("scheduler_reconcile_repairs_total", 'kind="republished"') == 1
    # The recent one may still be on its way to a worker.
    assert snapshot(recent.id) == recent_before
    assert not AuditEvent.objects.filter(run=recent).exists()

    # Its new row is pending now: the relay's job, not reconciliation's.
    assert (
        reconcile_run_once(now=NOW, config=CONFIG, queue_depth=depth, window=window).republished
        == 0
    )
    assert OutboxMessage.objects.filter(run=lost).count() == 1
    assert counter("scheduler_reconcile_repairs_total", 'kind="republished"') == 1


@pytest.mark.parametrize("depth", [1, None], ids=["messages-waiting", "depth-unknown"])
def test_a_queue_with_ready_messages_or_unknown_depth_is_left_alone(queued_run, depth, window):
    run = queued_run()
    publish(run, at=later(-THRESHOLD - 60))
    before = snapshot(run.id)

    result = reconcile_run_once(
        now=NOW, config=CONFIG, queue_depth=lambda queue: depth, window=window
    )

    assert result == ReconcileResult()
    assert snapshot(run.id) == before
    assert not AuditEvent.objects.filter(run=run).exists()
    assert not Counter.objects.filter(name="scheduler_reconcile_repairs_total").exists()


def test_a_run_whose_outbox_row_is_still_pending_is_left_alone(queued_run, window):
    run = queued_run(created=NOW - dt.timedelta(hours=1))
    before = snapshot(run.id)

    result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=empty_queue, window=window)

    # Only alarmed: the relay keeps trying to publish it. Marked held back (its
    # `updated_at` kept in `held_at`), so that later windows pass over it.
    assert result == ReconcileResult(outbox_stuck=1)
    marked = Run.objects.get(id=run.id)
    assert before[0]["held_at"] is None and marked.held_at == marked.updated_at
    after = snapshot(run.id)
    after[0]["held_at"] = None
    assert after == before
    assert not AuditEvent.objects.filter(run=run).exists()


def test_a_run_marked_held_back_then_published_late_and_lost_is_published_again(queued_run, window):
    """The mark of a held run is void once the relay publishes it late (its `updated_at`
    stamped, runs_stamp_published_late): lost then, it is found like any other."""
    run = queued_run(created=NOW - dt.timedelta(hours=2))
    reconcile_run_once(now=later(-5400), config=CONFIG, queue_depth=empty_queue, window=window)
    assert Run.objects.get(id=run.id).held_at == NOW - dt.timedelta(hours=2)
    OutboxMessage.objects.filter(run=run).delete()  # the relay, an hour late
    assert runs_stamp_published_late(run_ids=[run.id], now=later(-3600)) == 1

    result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=empty_queue, window=window)

    assert result.republished == 1
    assert Run.objects.get(id=run.id).republish_count == 1


def test_a_row_held_back_by_a_full_queue_or_an_owner_s_limit_is_not_alarmed(
    queued_run, user, caplog, window
):
    """Backpressure and owners' limits keep rows waiting on purpose: past the alarm's age
    they are only noted, unless the relay failed on them or nothing explains the wait."""
    import logging

    from jobs.models import ActiveRun, OwnerLimit

    caplog.set_level(logging.INFO, logger="dispatch.reconciler")
    queued_run(created=NOW - dt.timedelta(hours=1))
    full = dataclasses.replace(CONFIG, queue_high_water=10)

    def errors() -> list[str]:
        return [r.message for r in caplog.records if r.levelno >= logging.ERROR]

    assert reconcile_run_once(
        now=NOW, config=full, queue_depth=lambda queue: 10, window=window
    ) == ReconcileResult(outbox_held_back=1)
    assert reconcile_run_once(now=NOW, config=full, queue_depth=lambda queue: 9, window=window) == (
        ReconcileResult(outbox_stuck=1)
    )
    assert len(errors()) == 1
    # Its owner has its limit of runs in the broker or running.
    other = queued_run(created=NOW - dt.timedelta(hours=2))
    OutboxMessage.objects.filter(run=other).delete()
    ActiveRun.objects.create(run=other, owner=user, published_at=NOW)
    OwnerLimit.objects.create(owner=user, max_active_runs=1)
    assert reconcile_run_once(
        now=NOW, config=CONFIG, queue_depth=lambda queue: 9, window=window
    ) == ReconcileResult(outbox_held_back=1)
    # A row the relay failed on is stuck, whatever else holds it.
    OutboxMessage.objects.update(publish_tries=1, last_error="refused")
    assert reconcile_run_once(
        now=NOW, config=full, queue_depth=lambda queue: 10, window=window
    ) == ReconcileResult(outbox_stuck=1)
    assert len(errors()) == 2


def test_rows_held_back_do_not_hide_other_queues_stuck_rows(queued_run, caplog, window):
    """The oldest row waits on purpose (its queue at its mark); a younger row of another
    queue, whose wait nothing explains (a dead relay), still raises the ERROR."""
    import logging

    caplog.set_level(logging.INFO, logger="dispatch.reconciler")
    queued_run(created=NOW - dt.timedelta(hours=2))  # queue `jobs`, the oldest
    queued_run(created=NOW - dt.timedelta(hours=1), queue="other")
    full = dataclasses.replace(CONFIG, queue_high_water=10)

    def errors() -> list[str]:
        return [r.message for r in caplog.records if r.levelno >= logging.ERROR]

    depths = {"jobs": 10, "other": 0}
    assert reconcile_run_once(now=NOW, config=full, queue_depth=depths.get, window=window) == (
        ReconcileResult(outbox_stuck=1, outbox_held_back=1)
    )
    assert len(errors()) == 1
    # Both queues at their mark: both rows wait on purpose, no ERROR.
    depths["other"] = 10
    assert reconcile_run_once(now=NOW, config=full, queue_depth=depths.get, window=window) == (
        ReconcileResult(outbox_held_back=2)
    )
    assert len(errors()) == 1


def test_rows_a_relay_failed_on_are_alarmed_behind_any_number_held_back(
    queued_run, caplog, monkeypatch, window
):
    """More rows held back on purpose than the alarm reads (STUCK_ROWS, 3 here) come first;
    a younger row of another queue that a relay failed to publish still raises the ERROR:
    it is read through outbox_failing_idx, not found among the oldest."""
    import logging

    import dispatch.reconciler

    monkeypatch.setattr(dispatch.reconciler, "STUCK_ROWS", 3)
    caplog.set_level(logging.INFO, logger="dispatch.reconciler")
    for minutes in (50, 40, 30, 20):  # queue `jobs`, at its mark
        queued_run(created=NOW - dt.timedelta(hours=2, minutes=minutes))
    failing = queued_run(created=NOW - dt.timedelta(hours=1), queue="other")
    OutboxMessage.objects.filter(run=failing).update(publish_tries=2, last_error="refused")
    full = dataclasses.replace(CONFIG, queue_high_water=10)

    result = reconcile_run_once(
        now=NOW, config=full, queue_depth={"jobs": 10, "other": 0}.get, window=window
    )

    assert result == ReconcileResult(outbox_stuck=1, outbox_held_back=3)
    assert [r.levelno for r in caplog.records if r.levelno >= logging.ERROR] == [logging.ERROR]


def test_after_max_republish_tries_the_run_fails_as_undeliverable(queued_run, user, window):
    config = ReconcileConfig(queued_after_seconds=THRESHOLD, max_republish=2)
    run = queued_run()
    publish(run, at=NOW)
    at = NOW
    for attempt in (1, 2):
        # Each re-publication waits twice as long as the one before.
        at += dt.timedelta(seconds=THRESHOLD * 2 ** (attempt - 1) - 1)
        early = reconcile_run_once(now=at, config=config, queue_depth=empty_queue, window=window)
        assert early == ReconcileResult()
        at += dt.timedelta(seconds=2)
        result = reconcile_run_once(now=at, config=config, queue_depth=empty_queue, window=window)
        assert result == ReconcileResult(republished=1)
        assert Run.objects.get(id=run.id).republish_count == attempt
        publish(run, at=at)

    at += dt.timedelta(seconds=THRESHOLD * 4 + 1)
    result = reconcile_run_once(now=at, config=config, queue_depth=empty_queue, window=window)

    assert result == ReconcileResult(undeliverable=1)
    run.refresh_from_db()
    assert (run.state, run.failure_reason, run.finished_at) == (
        RunState.FAILED,
        "undeliverable",
        at,
    )
    assert run.republish_count == 2
    assert not OutboxMessage.objects.filter(run=run).exists()  # no fourth publication
    assert AuditEvent.objects.get(run=run, action="run.undeliverable").data == {"republished": 2}
    assert counter("scheduler_reconcile_repairs_total", 'kind="undeliverable"') == 1
    assert counter("scheduler_reconcile_repairs_total", 'kind="republished"') == 2
    # A later pass does nothing more.
    assert (
        reconcile_run_once(now=at, config=config, queue_depth=empty_queue, window=window)
        == ReconcileResult()
    )

    # An operator replay starts the republish count over.
    run = Run.objects.select_related("job_version").get(id=run.id)
    assert run_replay_request(run=run, actor=user, now=at) is True
    run.refresh_from_db()
    assert (run.state, run.republish_count, run.failure_reason) == (RunState.QUEUED, 0, "")


def test_the_real_broker_tells_a_queue_with_messages_from_a_missing_one(queued_run, window):
    busy = f"reconcile-busy-{uuid.uuid4().hex[:8]}"
    missing = f"reconcile-missing-{uuid.uuid4().hex[:8]}"
    depth = BrokerQueueDepth(settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    with Connection(settings.CELERY_BROKER_URL, transport_options={"confirm_publish": True}) as c:
        queue = Queue(busy, routing_key=busy, durable=False)
        try:
            c.Producer().publish({"waiting": True}, routing_key=busy, declare=[queue])
            assert depth(missing) == 0
            deadline = time.monotonic() + 5
            while depth(busy) != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            # The same connection still answers after the broker refused the missing queue.
            assert depth(busy) == 1
            assert depth(missing) == 0

            waiting = queued_run(queue=busy)
            lost = queued_run(queue=missing)
            for run in (waiting, lost):
                publish(run, at=later(-THRESHOLD - 1))
            waiting_before = snapshot(waiting.id)

            result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=depth, window=window)

            assert result == ReconcileResult(republished=1)
            assert snapshot(waiting.id) == waiting_before
            assert Run.objects.get(id=lost.id).republish_count == 1
            assert OutboxMessage.objects.filter(run=lost, state=OutboxState.PENDING).count() == 1
        finally:
            queue.bind(c.default_channel).delete()
            depth.close()


def test_a_run_whose_queue_delivered_later_messages_is_lost_even_while_the_queue_is_busy(
    queued_run,
    window,
):
    lost = queued_run()
    publish(lost, at=later(-3 * THRESHOLD))
    # Published only a minute before the message claimed below: it may be waiting in the
    # prefetch buffer of a busy worker.
    recent = queued_run()
    publish(recent, at=later(-THRESHOLD - 60))
    elsewhere = queued_run(queue="other")
    publish(elsewhere, at=later(-3 * THRESHOLD))
    delivered = queued_run()
    publish(delivered, at=later(-THRESHOLD))
    assert run_claim(run_id=delivered.id, worker="w", now=later(-THRESHOLD + 1), lease_seconds=30)
    # Created (so queued, so published) well after `lost` was queued.
    Run.objects.filter(id=delivered.id).update(created_at=later(-THRESHOLD))
    before = [snapshot(run.id) for run in (recent, elsewhere)]

    result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=lambda queue: 5, window=window)

    assert result == ReconcileResult(republished=1)
    assert Run.objects.get(id=lost.id).republish_count == 1
    assert OutboxMessage.objects.filter(run=lost).count() == 1
    event = AuditEvent.objects.get(run=lost, action="run.republished")
    assert event.data["lost_because"] == "later_message_claimed"
    assert [snapshot(run.id) for run in (recent, elsewhere)] == before
    # The claimed message was published before this republication: it says nothing of it.
    publish(lost, at=NOW)
    later_pass = reconcile_run_once(
        now=later(4 * THRESHOLD), config=CONFIG, queue_depth=lambda q: 5, window=window
    )
    assert later_pass == ReconcileResult()


def test_a_backlog_published_late_is_not_taken_for_lost_while_its_first_runs_are_claimed(
    queued_run,
    window,
):
    """After an outage of the relays, runs queued long ago are published at once; the
    first ones claimed were created as long ago as the rest, so nothing is republished."""
    waiting = [queued_run() for _ in range(3)]
    for run in waiting:
        publish(run, at=later(-3 * THRESHOLD))
    Run.objects.filter(id__in=[run.id for run in waiting]).update(created_at=later(-3 * THRESHOLD))
    claimed = waiting.pop()
    assert run_claim(run_id=claimed.id, worker="w", now=NOW, lease_seconds=30)
    # Its message was published just now, long after the others were queued.
    Run.objects.filter(id=claimed.id).update(published_at=NOW)
    before = [snapshot(run.id) for run in waiting]

    result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=lambda queue: 5, window=window)

    assert result == ReconcileResult()
    assert [snapshot(run.id) for run in waiting] == before


# --- orphaned running runs -------------------------------------------------------------


def orphan(run: Run, *, updated_at: dt.datetime) -> Attempt:
    """A running run whose only attempt no longer runs: what a bug or a hand edit leaves."""
    publish(run, at=later(-121))
    attempt = run_claim(run_id=run.id, worker="w", now=later(-120), lease_seconds=30)
    assert attempt is not None
    Attempt.objects.filter(id=attempt.id).update(state=AttemptState.FAILED)
    Run.objects.filter(id=run.id).update(updated_at=updated_at)
    return attempt


@pytest.mark.parametrize(
    ("max_attempts", "state", "next_attempt_at", "reason"),
    [(3, RunState.RETRY_WAIT, later(10), ""), (1, RunState.FAILED, None, "lost")],
    ids=["retries", "no-attempt-left"],
)
def test_a_running_run_without_a_live_attempt_is_repaired(
    queued_run, max_attempts, state, next_attempt_at, reason, window
):
    retry = {"max_attempts": max_attempts, "initial_delay_seconds": 10, "jitter": False}
    run = queued_run(retry=retry)
    attempt = orphan(run, updated_at=later(-CONFIG.running_orphan_after_seconds + 1))
    live_run = queued_run()
    publish(live_run, at=later(-121))
    live = run_claim(run_id=live_run.id, worker="w", now=later(-120), lease_seconds=30)
    Run.objects.filter(id=live_run.id).update(updated_at=later(-3600))
    live_before = snapshot(live_run.id)

    # Not before it has looked orphaned for running_orphan_after_seconds.
    assert reconcile_run_once(now=NOW, config=CONFIG, queue_depth=empty_queue, window=window) == (
        ReconcileResult()
    )
    assert Run.objects.get(id=run.id).state == RunState.RUNNING

    Run.objects.filter(id=run.id).update(updated_at=later(-CONFIG.running_orphan_after_seconds - 1))
    result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=empty_queue, window=window)

    assert result == ReconcileResult(orphans_repaired=1)
    run.refresh_from_db()
    assert (run.state, run.next_attempt_at, run.failure_reason) == (state, next_attempt_at, reason)
    assert run.finished_at == (NOW if state == RunState.FAILED else None)
    event = AuditEvent.objects.get(run=run, action="run.orphan_repaired")
    assert (event.actor_label, event.data) == (
        "system:reconciler",
        {"fencing_token": 1, "to": state},
    )
    assert counter("scheduler_reconcile_repairs_total", 'kind="orphaned_running"') == 1
    assert Attempt.objects.get(id=attempt.id).state == AttemptState.FAILED
    # The running run with its live attempt is untouched.
    assert snapshot(live_run.id) == live_before
    assert Attempt.objects.get(id=live.id).state == AttemptState.RUNNING
    assert not AuditEvent.objects.filter(run=live_run).exists()


def test_a_backlogged_queue_does_not_starve_lost_messages_on_other_queues(queued_run, window):
    config = ReconcileConfig(queued_after_seconds=THRESHOLD, batch_size=2)
    backlog = [queued_run(queue="backlog", created=NOW - dt.timedelta(hours=2)) for _ in range(2)]
    lost = queued_run(queue="jobs", created=NOW - dt.timedelta(hours=1))
    for run in (*backlog, lost):
        publish(run, at=later(-THRESHOLD - 1))
    depths = {"backlog": 100, "jobs": 0}

    for _ in range(3):
        reconcile_run_once(now=NOW, config=config, queue_depth=depths.__getitem__, window=window)

    assert all(Run.objects.get(id=run.id).republish_count == 0 for run in backlog)
    assert Run.objects.get(id=lost.id).republish_count == 1
    assert OutboxMessage.objects.filter(run=lost, state=OutboxState.PENDING).count() == 1


def test_a_lost_backfill_or_manual_run_is_judged_by_its_lane_and_sent_there_again(
    queued_run, user, window
):
    """Backfill and manual runs travel in their job's queue's lanes (jobs.lanes): their
    queue's depth is asked of the lane, and the republished row goes to the lane."""
    from jobs.services import job_backfill, job_trigger

    job = queued_run().job
    created = NOW - dt.timedelta(hours=1)
    [backfilled] = job_backfill(job=job, instants=[created - dt.timedelta(days=1)],
                                actor=user, now=created).created  # fmt: skip
    triggered = job_trigger(job=job, actor=user, now=created)
    assert dict(OutboxMessage.objects.values_list("run_id", "queue")) == {
        Run.objects.get(job=job, kind="scheduled").id: "jobs",
        backfilled.id: "jobs.backfill",
        triggered.id: "jobs.manual",
    }
    for run in Run.objects.filter(job=job):
        publish(run, at=later(-THRESHOLD - 1))
    asked = []

    def depth(queue: str) -> int:
        asked.append(queue)
        return 0

    assert (
        reconcile_run_once(now=NOW, config=CONFIG, queue_depth=depth, window=window).republished
        == 3
    )
    assert sorted(asked) == ["jobs", "jobs.backfill", "jobs.manual"]
    assert dict(OutboxMessage.objects.values_list("run_id", "queue")) == {
        Run.objects.get(job=job, kind="scheduled").id: "jobs",
        backfilled.id: "jobs.backfill",
        triggered.id: "jobs.manual",
    }


def test_a_lost_replayed_run_is_judged_by_the_replay_lane_and_sent_there_again(
    queued_run, user, window
):
    """A replayed run travels in `<queue>.replay` (jobs.lanes) from its replay on: its
    lost message is asked of that lane's depth and republished there."""
    run = queued_run()
    OutboxMessage.objects.filter(run=run).delete()
    Run.objects.filter(id=run.id).update(state=RunState.FAILED, failure_reason="error")
    run = Run.objects.select_related("job_version").get(id=run.id)
    assert run_replay_request(run=run, actor=user, now=later(-THRESHOLD - 10)) is True
    assert OutboxMessage.objects.get(run=run).queue == "jobs.replay"
    publish(run, at=later(-THRESHOLD - 1))
    asked = []

    def depth(queue: str) -> int:
        asked.append(queue)
        return 0

    result = reconcile_run_once(now=NOW, config=CONFIG, queue_depth=depth, window=window)
    assert result.republished == 1
    assert asked == ["jobs.replay"]
    assert OutboxMessage.objects.get(run=run).queue == "jobs.replay"
