"""storage.idempotency: taking keys by inserting their records, and filling the answers;
a key another open transaction holds makes the insert wait for it."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction

from jobs.models import IdempotencyRecord
from storage.idempotency import (
    idempotency_record_insert_answered,
    idempotency_records_answer,
    idempotency_records_insert_pending,
)
from tests.threads import in_thread, wait_for_lock_waiters

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
SCOPE = "jobs.create"


def pending(user, *keys: str) -> set[str]:
    return idempotency_records_insert_pending(
        owner_id=user.pk, scope=SCOPE, pending=[(key, f"hash-{key}") for key in keys], now=NOW
    )


@pytest.mark.django_db
def test_pending_records_are_inserted_for_new_keys_only(user, other_user):
    assert pending(user, "a", "b") == {"a", "b"}
    assert pending(user, "a", "c") == {"c"}  # `a` has its record: skipped
    assert pending(other_user, "a") == {"a"}  # keys are per owner
    assert pending(user) == set()
    record = IdempotencyRecord.objects.get(owner=user, scope=SCOPE, key="c")
    assert (record.request_hash, record.response_status, record.response_body) == (
        "hash-c",
        0,
        {},
    )
    assert record.created_at == NOW


@pytest.mark.django_db
def test_the_answers_fill_the_pending_records(user, other_user):
    pending(user, "a", "b")
    pending(other_user, "a")
    filled = idempotency_records_answer(
        owner_id=user.pk, scope=SCOPE, status=201, bodies={"a": {"id": 1}, "b": [1, "two"]}
    )
    assert filled == 2
    answers = dict(IdempotencyRecord.objects.filter(owner=user).values_list("key", "response_body"))
    assert answers == {"a": {"id": 1}, "b": [1, "two"]}
    assert IdempotencyRecord.objects.get(owner=user, key="a").response_status == 201
    assert IdempotencyRecord.objects.get(owner=other_user).response_status == 0  # untouched


@pytest.mark.django_db
def test_an_answered_record_is_inserted_unless_the_key_has_one(user):
    def answered(key: str) -> bool:
        return idempotency_record_insert_answered(
            owner_id=user.pk, scope=SCOPE, key=key, request_hash="h", status=201,
            body={"id": key}, now=NOW,
        )  # fmt: skip

    assert answered("a") is True
    assert answered("a") is False
    pending(user, "b")
    assert answered("b") is False
    record = IdempotencyRecord.objects.get(key="a")
    assert (record.response_status, record.response_body) == (201, {"id": "a"})


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("holder_commits", [True, False])
def test_a_key_held_by_an_open_transaction_waits_for_it(user, holder_commits):
    """The second connection's insert waits on idempotency_key_unique until the holder
    ends: a committed holder keeps the key, a rolled-back one leaves it to the waiter."""
    taken = []
    with transaction.atomic():
        assert pending(user, "k") == {"k"}
        other = in_thread(lambda: taken.append(pending(user, "k")))
        wait_for_lock_waiters(1)
        assert taken == []
        if not holder_commits:
            transaction.set_rollback(True)
    other.join(timeout=20)
    assert taken == [set() if holder_commits else {"k"}]
    assert IdempotencyRecord.objects.filter(key="k").count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_answered_insert_waits_for_the_holder_of_its_key(user):
    inserted = []
    with transaction.atomic():
        pending(user, "k")
        other = in_thread(
            lambda: inserted.append(
                idempotency_record_insert_answered(
                    owner_id=user.pk,
                    scope=SCOPE,
                    key="k",
                    request_hash="h",
                    status=201,
                    body={},
                    now=NOW,
                )  # fmt: skip
            )
        )
        wait_for_lock_waiters(1)
        assert inserted == []
    other.join(timeout=20)
    assert inserted == [False]
