"""storage.shares against PostgreSQL: the owners of a queue's pending rows with their
limits, and the limits' advisory locks raced on two connections."""

from __future__ import annotations

import threading

import pytest
from django.db import transaction

from jobs.models import OutboxMessage, OwnerLimit
from storage.shares import (
    OWNER_LIMIT_TABLE,
    PendingOwner,
    owner_limits_try_lock,
    owners_count_active,
    owners_list_pending,
)
from tests.factories import owner
from tests.threads import in_thread


def test_the_owner_limit_table_is_the_models():
    from jobs.models import OWNER_LIMIT_STATES, Run
    from storage.shares import ACTIVE_STATES, RUN_TABLE

    assert OWNER_LIMIT_TABLE == OwnerLimit._meta.db_table
    assert (RUN_TABLE, ACTIVE_STATES) == (Run._meta.db_table, list(OWNER_LIMIT_STATES))


def test_the_owners_of_a_queues_pending_rows_with_their_limits(queued_run):
    users = [owner(f"shares-{index}") for index in range(4)]
    runs = [queued_run(owner=user) for user in users]  # each with its row in `jobs`
    OutboxMessage.objects.filter(run=runs[3]).update(queue="elsewhere")
    OwnerLimit.objects.create(owner=users[0], max_active_runs=3)
    OwnerLimit.objects.create(owner=users[1], max_active_runs=None)
    ids = sorted(user.id for user in users[:3])
    limits = {users[0].id: (True, 3), users[1].id: (True, None), users[2].id: (False, None)}
    expected = [PendingOwner(owner_id, *limits[owner_id]) for owner_id in ids]

    assert owners_list_pending(queue="jobs", after=None, limit=10) == expected
    assert owners_list_pending(queue="jobs", after=None, limit=2) == expected[:2]
    assert owners_list_pending(queue="jobs", after=ids[1], limit=10) == expected[2:]
    assert owners_list_pending(queue="elsewhere", after=None, limit=10) == [
        PendingOwner(users[3].id, False, None)
    ]
    assert owners_list_pending(queue="nowhere", after=None, limit=10) == []


def test_no_owners_take_no_lock(db):
    assert owner_limits_try_lock(owners=[]) == set()


@pytest.mark.django_db(transaction=True)
def test_an_owners_limit_is_held_by_one_transaction_at_a_time():
    holding, release = threading.Event(), threading.Event()
    errors: list = []
    first: set = set()

    def lock_and_hold() -> None:
        with transaction.atomic():
            first.update(owner_limits_try_lock(owners=[1, 2]))
            holding.set()
            release.wait(10)

    thread = in_thread(lock_and_hold, errors)
    try:
        assert holding.wait(10)
        with transaction.atomic():
            assert owner_limits_try_lock(owners=[2, 3]) == {3}
    finally:
        release.set()
        thread.join(10)
    assert errors == []
    assert first == {1, 2}
    # Released at commit (this transaction's own, at its end, too).
    with transaction.atomic():
        assert owner_limits_try_lock(owners=[1, 2, 3]) == {1, 2, 3}


def test_an_owner_s_active_runs_and_live_claims_count_and_a_lapsed_claim_does_not(queued_run):
    import uuid

    from jobs.models import ActiveRun, RunState
    from storage.outbox import outbox_claim_pending

    user = owner("counted")
    published, running, finished, claimed, lapsed = (queued_run(owner=user) for _ in range(5))
    for run, state in ((published, RunState.QUEUED), (running, RunState.RUNNING),
                       (finished, RunState.SUCCEEDED)):  # fmt: skip
        OutboxMessage.objects.filter(run=run).delete()
        type(run).objects.filter(id=run.id).update(state=state)
        ActiveRun.objects.create(run=run, owner=user, published_at=run.created_at)
    assert owners_count_active(owners=[user.id]) == {user.id: 2}
    rows = outbox_claim_pending(queue="jobs", quotas={user.id: 2}, exclude=[], claim=uuid.uuid4())
    assert {row.run_id for row in rows} == {claimed.id, lapsed.id}
    assert owners_count_active(owners=[user.id]) == {user.id: 4}
    OutboxMessage.objects.filter(run=lapsed).update(claimed_until="2000-01-01T00:00:00Z")
    assert owners_count_active(owners=[user.id, owner("idle").id]) == {user.id: 3}
