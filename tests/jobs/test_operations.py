"""Bulk operations without processes: a dry run counts, an operation freezes its targets
(rows that arrive later are untouched), works in bounded batches through the single
actions (the actor on each audit event), counts refusals by reason, and only ever
touches the caller's own runs."""

import pytest
from django.db import transaction

from dispatch.operations import OperationsConfig, operations_run_once
from jobs.clock import db_now
from jobs.models import AuditEvent, BulkOperation, Run, RunState
from tests.factories import claim

pytestmark = pytest.mark.django_db


SMALL_BATCHES = OperationsConfig(batch_size=2)


def _drain(config=SMALL_BATCHES) -> int:
    steps = 0
    while operations_run_once(now=db_now(), config=config).done:
        steps += 1
        assert steps < 100
    return steps


def test_a_bulk_cancel_counts_first_then_acts_on_the_frozen_match(api, user, other_user,
                                                                   queued_run):  # fmt: skip
    mine = [queued_run(owner=user) for _ in range(5)]
    claim(mine[0])
    Run.objects.filter(id=mine[1].id).update(state=RunState.SUCCEEDED)
    theirs = queued_run(owner=other_user)
    body = {"filter": {}, "dry_run": True}
    assert api.post("/api/v1/runs/bulk/cancel/", body, format="json").json() == {"matched": 5}
    answer = api.post("/api/v1/runs/bulk/cancel/", {"filter": {}}, format="json",
                      HTTP_IDEMPOTENCY_KEY="cancel-all-1")  # fmt: skip
    assert answer.status_code == 202, answer.content
    operation = answer.json()
    assert operation["state"] == "running" and operation["matched"] == 5
    again = api.post("/api/v1/runs/bulk/cancel/", {"filter": {}}, format="json",
                     HTTP_IDEMPOTENCY_KEY="cancel-all-1")  # fmt: skip
    assert again.json()["id"] == operation["id"]
    assert BulkOperation.objects.count() == 1
    late = queued_run(owner=user)  # after the operation: not among its targets
    assert _drain() == 3  # 5 items, 2 a batch
    status = api.get(f"/api/v1/operations/{operation['id']}/").json()
    assert status["state"] == "done"
    assert (status["matched"], status["done"], status["refused"]) == (5, 4, {"state_succeeded": 1})
    assert Run.objects.get(id=late.id).state == RunState.QUEUED
    assert Run.objects.get(id=theirs.id).state == RunState.QUEUED
    cancels = AuditEvent.objects.filter(action__startswith="run.cancel", actor=user)
    assert cancels.count() >= 4


def test_bulk_filters_are_the_lists_and_typos_are_named(api):
    answer = api.post("/api/v1/runs/bulk/replay/", {"filter": {"status": "failed"}},
                      format="json")  # fmt: skip
    assert answer.status_code == 400 and "status" in answer.json()["filter"]
    answer = api.post("/api/v1/jobs/bulk/pause/", {"filter": {"state": "nope"}}, format="json")
    assert answer.status_code == 400 and "state" in answer.json()["filter"]
    answer = api.post("/api/v1/jobs/bulk/pause/", {"filters": {}}, format="json")
    assert answer.status_code == 400 and "filters" in answer.json()


def test_bulk_pause_and_resume_of_jobs(api, user, make_job):
    jobs = [make_job() for _ in range(3)]
    answer = api.post("/api/v1/jobs/bulk/pause/", {"filter": {"state": "active"}}, format="json")
    assert answer.json()["matched"] == 3
    _drain()
    assert {job.state for job in type(jobs[0]).objects.filter(id__in=[j.id for j in jobs])} == {
        "paused"
    }
    api.post("/api/v1/jobs/bulk/resume/", {"filter": {}}, format="json")
    _drain()
    assert {job.state for job in type(jobs[0]).objects.filter(id__in=[j.id for j in jobs])} == {
        "active"
    }


def test_another_owner_cannot_see_an_operation(api, other_user):
    operation = BulkOperation.objects.create(owner=other_user, action="runs.cancel")
    assert api.get(f"/api/v1/operations/{operation.id}/").status_code == 404


def test_the_admin_offers_all_n_matching_with_the_count_first(client, queued_run, user):
    from tests.factories import superuser

    runs = [queued_run(owner=user) for _ in range(3)]
    Run.objects.filter(id__in=[run.id for run in runs[:2]]).update(state=RunState.FAILED)
    client.force_login(superuser("admin-bulk"))
    url = "/admin/jobs/run/?state__exact=failed"
    post = {"action": "replay_runs", "select_across": "1", "_selected_action": ["all"]}
    page = client.post(url, post)
    assert page.status_code == 200
    assert b"all <strong>2</strong>" in page.content
    assert not BulkOperation.objects.exists()  # nothing before the confirmation
    answer = client.post(url, {**post, "confirm": "yes"})
    assert answer.status_code == 302
    operation = BulkOperation.objects.get()
    assert (operation.action, operation.matched) == ("runs.replay", 2)
    _drain()
    assert Run.objects.filter(state=RunState.QUEUED).count() == 3


@pytest.mark.parametrize("action", ["runs.cancel", "jobs.cancel"])
@pytest.mark.django_db(transaction=True)
def test_a_bulk_cancel_batch_and_a_packed_success_never_deadlock(
    queued_run, user, monkeypatch, action
):
    """Two running runs of one pack (of two jobs), the batch's items (the runs, or their
    jobs) in the opposite order of their attempts' ids. Session A (the batch) cancels the
    first item, then waits until session B (the pack's success: its attempts locked in id
    order) is blocked, then goes on: cancelled one by one, A held the higher attempt and
    wanted the lower one B holds."""
    import threading

    from jobs import operations
    from jobs.models import BulkOperationItem
    from jobs.transitions import attempts_succeed
    from tests.threads import in_thread, wait_for_lock_waiters

    runs = [queued_run(args=[n]) for n in range(2)]
    attempts = sorted((claim(run) for run in runs), key=lambda attempt: attempt.id)
    operation = BulkOperation.objects.create(owner=user, action=action, matched=2)
    jobs = {run.id: run.job_id for run in runs}
    for attempt in reversed(attempts):  # the higher attempt's run (or job) first
        target = attempt.run_id if action == "runs.cancel" else jobs[attempt.run_id]
        BulkOperationItem.objects.create(operation=operation, target=target)
    first_done = threading.Event()
    act = operations._act

    def act_then_wait(*args):
        outcome = act(*args)
        if not first_done.is_set():
            first_done.set()
            wait_for_lock_waiters(1)
        return outcome

    monkeypatch.setattr(operations, "_act", act_then_wait)

    def session_b() -> None:
        assert first_done.wait(20)
        with transaction.atomic():
            attempts_succeed(outcomes=[(attempt, None) for attempt in attempts])

    errors: list = []
    threads = [in_thread(lambda: operations.operations_run_batch(now=db_now(), batch_size=10),
                         errors), in_thread(session_b, errors)]  # fmt: skip
    for thread in threads:
        thread.join(40)
    assert errors == []
    operation.refresh_from_db()
    assert operation.state == BulkOperation.State.DONE and operation.done == 2
