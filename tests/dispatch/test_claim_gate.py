"""The worker's claim with the queue's gate folded in: a run of a queue without a control in
force is claimed in one statement, which share-locks the queue's control row (a pause waits
for it); a run of a paused, capped or rate-limited queue is left to dispatch.queues."""

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from dispatch.worker.delivery import HANDED_BACK, _claim
from jobs.models import QueueControl, RunState
from jobs.transitions import run_claim
from tests.threads import in_thread, wait_for_lock_waiters


def _deliver(run):
    return _claim(run_id=str(run.id), worker="worker-a", published_at=None, task_id="t")


@pytest.mark.django_db
@pytest.mark.parametrize("control", [None, {"paused": False}, {"paused": True, "until": "past"}])
def test_a_run_of_an_uncontrolled_queue_is_claimed_in_one_statement(queued_run, control):
    import datetime as dt

    run = queued_run()
    if control is not None:
        until = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1) if control.get("until") else None
        QueueControl.objects.create(name="jobs", paused=control["paused"], paused_until=until)
    with CaptureQueriesContext(connection) as statements:
        attempt = _deliver(run)
    assert attempt is not None and attempt.run.state == RunState.RUNNING
    assert len(statements) == 1, [s["sql"][:80] for s in statements]


@pytest.mark.django_db
@pytest.mark.parametrize("control", [{"paused": True}, {"max_running": 5}, {"rate_per_second": 1.0,
                         "burst": 1.0, "tokens": 1.0}])  # fmt: skip
def test_the_gated_claim_leaves_a_controlled_queues_run_to_the_gate(queued_run, control):
    run = queued_run()
    QueueControl.objects.create(name="jobs", **control)
    assert run_claim(run_id=run.id, worker="worker-a", gated=True) is None
    run.refresh_from_db()
    assert run.state == RunState.QUEUED and run.attempt_count == 0
    # Through the gate: a pause hands it back; a cap with room or a token claims it.
    answer = _deliver(run)
    if control.get("paused"):
        assert answer == HANDED_BACK
    else:
        assert answer.run.state == RunState.RUNNING
        if "rate_per_second" in control:
            assert QueueControl.objects.get(name="jobs").tokens < 1.0


@pytest.mark.django_db(transaction=True)
def test_a_pause_waits_for_the_one_statement_claim_in_flight(queued_run):
    first, second = queued_run(), queued_run()
    QueueControl.objects.create(name="jobs")
    errors: list = []
    with transaction.atomic():
        assert run_claim(run_id=first.id, worker="worker-a", gated=True) is not None
        pausing = in_thread(
            lambda: QueueControl.objects.filter(name="jobs").update(paused=True), errors
        )
        wait_for_lock_waiters(1)  # the pause waits for the claim's transaction
    pausing.join(timeout=20)
    assert not pausing.is_alive() and not errors
    assert run_claim(run_id=second.id, worker="worker-a", gated=True) is None
    assert _deliver(second) == HANDED_BACK
