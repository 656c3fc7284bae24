"""Every cancellation race has one winner (docs/semantics.md), and replay of a failed run,
with real scheduler, relay and worker processes and the REST API."""

import pytest

from jobs.models import AttemptState, OutboxMessage, Run, RunState
from tests.factories import api_client, one_time_job, owner
from tests.fault_tasks import EFFECT_COUNTER, effect_labels
from tests.faults.helpers import counter
from tests.faults.invariants import invariant_violations
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


@pytest.fixture
def client():
    return api_client(owner())


def _run_of(job) -> Run:
    return wait_for(lambda: Run.objects.filter(job=job).first(), timeout=30,
                    message="the run to be created")  # fmt: skip


def test_cancel_before_publication_sends_nothing(stack, client):
    stack.scheduler()
    run = _run_of(one_time_job(task="faults.work"))
    assert OutboxMessage.objects.filter(run=run, state="pending").exists()

    response = client.post(f"/api/v1/runs/{run.id}/cancel/")
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "cancelled"
    stack.relay()
    stack.worker()
    other = _run_of(one_time_job(task="faults.work"))  # proves the pipeline is live
    wait_for(lambda: Run.objects.get(id=other.id).state == RunState.SUCCEEDED, timeout=30)

    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and run.attempt_count == 0
    assert not OutboxMessage.objects.filter(run=run).exists()
    assert {e["run_id"] for e in stack.executions()} == {str(other.id)}


def test_cancel_after_publication_the_worker_refuses_the_claim(stack, client):
    stack.scheduler()
    stack.relay()
    run = _run_of(one_time_job(task="faults.work"))
    # A confirmed message's outbox row is deleted.
    wait_for(lambda: not OutboxMessage.objects.filter(run=run).exists(),
             timeout=30, message="publication")  # fmt: skip

    assert client.post(f"/api/v1/runs/{run.id}/cancel/").status_code == 200
    stack.worker()
    wait_for(lambda: b"was cancelled before a worker claimed it" in stack.log("worker"),
             timeout=30, message="the worker to refuse the cancelled run")  # fmt: skip
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED
    assert run.attempt_count == 0 and run.duplicate_deliveries == 0
    assert stack.executions() == []


def test_cancel_while_running_stops_the_handler_and_refuses_its_completion(stack, client):
    stack.scheduler()
    stack.relay()
    stack.worker()
    run = _run_of(one_time_job(task="faults.until_cancelled", heartbeat_timeout_seconds=3))
    wait_for(lambda: any(e["event"] == "started" for e in stack.executions()), timeout=30,
             message="the handler to start")  # fmt: skip

    response = client.post(f"/api/v1/runs/{run.id}/cancel/")
    assert response.status_code == 200
    saw = wait_for(lambda: [e for e in stack.executions() if e["event"] == "saw_cancel"],
                   timeout=10, message="the handler to see the cancel")  # fmt: skip
    assert saw[0]["cancel_requested"] is True
    wait_for(lambda: counter("scheduler_stale_completions_total", 'kind="completion"') == 1,
             timeout=20, message="the late completion to be refused")  # fmt: skip

    run.refresh_from_db()
    assert run.state == RunState.CANCELLED
    assert [a.state for a in run.attempts.all()] == [AttemptState.CANCELLED]
    # The effect it tried after the cancel was refused by the fence, and not counted as a
    # heartbeat of a stale owner: the cancel was deliberate.
    assert counter(EFFECT_COUNTER, effect_labels(run.id)) == 0
    assert counter("scheduler_stale_completions_total", 'kind="effect"') == 1
    assert counter("scheduler_stale_completions_total", 'kind="heartbeat"') == 0

    # After completion (here: after the cancel won), a cancel is refused and changes nothing.
    again = client.post(f"/api/v1/runs/{run.id}/cancel/")
    assert again.status_code == 409 and again.json()["state"] == "cancelled"


def test_cancel_after_success_is_refused(stack, client):
    stack.scheduler()
    stack.relay()
    stack.worker()
    run = _run_of(one_time_job(task="faults.work"))
    wait_for(lambda: Run.objects.get(id=run.id).state == RunState.SUCCEEDED, timeout=30)
    response = client.post(f"/api/v1/runs/{run.id}/cancel/")
    assert response.status_code == 409
    assert response.json() == {
        "detail": "a succeeded run cannot be cancelled",
        "state": "succeeded",
    }
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED


def test_replay_of_a_failed_run_is_a_new_attempt_of_the_same_run(stack, client):
    stack.scheduler()
    stack.relay()
    stack.worker()
    run = _run_of(one_time_job(task="faults.fail_first", retry={"max_attempts": 1}))
    wait_for(lambda: Run.objects.get(id=run.id).state == RunState.FAILED, timeout=30)
    assert client.post(f"/api/v1/runs/{run.id}/replay/").status_code == 200
    wait_for(lambda: Run.objects.get(id=run.id).state == RunState.SUCCEEDED, timeout=30)

    run.refresh_from_db()
    attempts = list(run.attempts.order_by("number"))
    assert [(a.number, a.fencing_token, a.state) for a in attempts] == [
        (1, 1, AttemptState.FAILED),
        (2, 2, AttemptState.SUCCEEDED),
    ]
    keys = {e["run_id"] for e in stack.executions()}
    assert keys == {str(run.id)} and run.result == {"attempt": 2}
    # A succeeded run cannot be replayed.
    refused = client.post(f"/api/v1/runs/{run.id}/replay/")
    assert refused.status_code == 409 and refused.json()["state"] == "succeeded"
    assert invariant_violations() == []
