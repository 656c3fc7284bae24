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
    owners_list_pending,
)
from tests.factories import owner
from tests.threads import in_thread


def test_the_owner_limit_table_is_the_models():
    assert OWNER_LIMIT_TABLE == OwnerLimit._meta.db_table


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
