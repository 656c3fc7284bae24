"""storage.outbox against PostgreSQL: each operation, and the claims raced on two
connections."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import transaction

from jobs.models import ActiveRun, Job, OutboxMessage, OutboxState
from storage.outbox import (
    ACTIVE_RUN_TABLE,
    JOB_TABLE,
    OUTBOX_COLUMNS,
    OUTBOX_TABLE,
    PENDING,
    OutboxEntry,
    outbox_claim_keep,
    outbox_claim_pending,
    outbox_delete_published,
    outbox_discard_pending,
    outbox_enqueue_many,
    outbox_pending_queues,
    outbox_record_failed_try,
)
from tests.factories import PINNED_NOW
from tests.threads import in_thread

NOW = PINNED_NOW


def _row(run, *, queue: str = "jobs", priority: int = 0, owner_id=None) -> OutboxMessage:
    """A pending row of `run` written through the ORM (the statements under test read it)."""
    return OutboxMessage.objects.create(
        run=run,
        owner_id=owner_id or run.job.owner_id,
        task_name="tests.record",
        queue=queue,
        priority=priority,
        created_at=NOW,
    )


@pytest.fixture
def bare_run(queued_run):
    """A queued run whose outbox row the scheduler wrote is gone: the test writes its own."""

    def make(**overrides):
        run = queued_run(**overrides)
        OutboxMessage.objects.filter(run=run).delete()
        return run

    return make


def test_the_names_storage_uses_are_the_models():
    """storage imports no model: its table names, columns and state are checked here."""
    assert (OUTBOX_TABLE, ACTIVE_RUN_TABLE, JOB_TABLE) == (
        OutboxMessage._meta.db_table,
        ActiveRun._meta.db_table,
        Job._meta.db_table,
    )
    assert PENDING == OutboxState.PENDING
    columns = {field.column for field in OutboxMessage._meta.concrete_fields} - {"id"}
    assert sorted(OUTBOX_COLUMNS.replace(" ", "").split(",")) == sorted(columns)


def test_enqueue_writes_pending_rows_of_the_jobs_owners_and_uncounts_the_runs(
    bare_run, user, other_user
):
    mine, theirs = bare_run(), bare_run(owner=other_user)
    ActiveRun.objects.create(run=mine, owner=user, published_at=NOW)
    entries = [
        OutboxEntry(run_id=run.id, job_id=run.job_id, task_name="tests.record", queue=queue,
                    priority=priority, timeout_seconds=timeout)
        for run, queue, priority, timeout in (
            (mine, "jobs", 3, 30), (theirs, "jobs.manual", 0, None)
        )
    ]  # fmt: skip
    assert outbox_enqueue_many(entries=entries, now=NOW) == 2
    assert outbox_enqueue_many(entries=[], now=NOW) == 0
    rows = {row.run_id: row for row in OutboxMessage.objects.all()}
    assert {run_id: (row.owner_id, row.queue, row.priority, row.timeout_seconds)
            for run_id, row in rows.items()} == {
        mine.id: (user.id, "jobs", 3, 30),
        theirs.id: (other_user.id, "jobs.manual", 0, None),
    }  # fmt: skip
    for row in rows.values():
        assert (row.state, row.created_at, row.publish_tries, row.last_error) == (
            OutboxState.PENDING, NOW, 0, ""
        )  # fmt: skip
    assert rows[mine.id].message_id != rows[theirs.id].message_id
    assert not ActiveRun.objects.exists()


def test_delete_published_and_a_failed_try(bare_run):
    run = bare_run()
    first, second = _row(run), _row(run)
    assert outbox_record_failed_try(message_ids=[first.id, second.id], error="refused") == 2
    assert outbox_record_failed_try(message_ids=[first.id], error="again") == 1
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.publish_tries, first.last_error) == (2, "again")
    assert (second.publish_tries, second.last_error) == (1, "refused")
    assert outbox_delete_published(message_ids=[first.id]) == [first.id]
    assert list(OutboxMessage.objects.values_list("id", flat=True)) == [second.id]
    assert outbox_delete_published(message_ids=[first.id]) == []


def test_a_lasting_refusal_is_dated_from_the_first_and_any_other_failure_clears_it(bare_run):
    run = bare_run()
    row = _row(run)
    later = NOW + dt.timedelta(minutes=1)

    def refused_since():
        return OutboxMessage.objects.get(id=row.id).refused_since

    outbox_record_failed_try(message_ids=[row.id], error="406", refused_at=NOW)
    outbox_record_failed_try(message_ids=[row.id], error="406", refused_at=later)
    assert refused_since() == NOW
    outbox_record_failed_try(message_ids=[row.id], error="an outage")
    assert refused_since() is None
    outbox_record_failed_try(message_ids=[row.id], error="406", refused_at=later)
    assert refused_since() == later
    assert OutboxMessage.objects.get(id=row.id).publish_tries == 4


def test_the_pending_queues_in_order_of_name(bare_run):
    run = bare_run()
    for queue in ("jobs", "b", "jobs", "a.manual", "b"):
        _row(run, queue=queue)
    assert outbox_pending_queues(limit=10) == ["a.manual", "b", "jobs"]
    assert outbox_pending_queues(limit=2) == ["a.manual", "b"]
    OutboxMessage.objects.all().delete()
    assert outbox_pending_queues(limit=10) == []


def test_a_claim_takes_each_owners_quota_by_priority_then_oldest(bare_run, user, other_user):
    mine, theirs = bare_run(), bare_run(owner=other_user)
    low, high, old, _other_queue = (
        _row(mine, priority=0), _row(mine, priority=5), _row(mine, priority=0),
        _row(mine, queue="elsewhere", priority=9),
    )  # fmt: skip
    their_rows = [_row(theirs) for _ in range(3)]
    claimed = outbox_claim_pending(queue="jobs", quotas={user.id: 2, other_user.id: 1}, exclude=[])
    mine_claimed = [m for m in claimed if m.owner_id == user.id]
    assert [m.id for m in mine_claimed] == [high.id, low.id]
    assert [m.id for m in claimed if m.owner_id == other_user.id] == [their_rows[0].id]
    message = mine_claimed[0]
    assert (message.message_id, message.run_id, message.task_name, message.queue,
            message.priority, message.timeout_seconds, message.created_at) == (
        high.message_id, mine.id, "tests.record", "jobs", 5, None, NOW
    )  # fmt: skip
    # Rows claimed earlier in the step are passed over, and so are rows a claim holds.
    again = outbox_claim_pending(queue="jobs", quotas={user.id: 5}, exclude=[high.id])
    assert [m.id for m in again] == [old.id]


@pytest.mark.django_db(transaction=True)
def test_two_relays_claiming_at_once_split_the_rows(bare_run, user):
    run = bare_run()
    rows = [_row(run, priority=priority) for priority in (9, 9, 0, 0)]
    holding, release = threading.Event(), threading.Event()
    first: list = []
    errors: list = []

    def claim_and_hold() -> None:
        with transaction.atomic():
            first.extend(outbox_claim_pending(queue="jobs", quotas={user.id: 2}, exclude=[]))
            holding.set()
            release.wait(10)

    thread = in_thread(claim_and_hold, errors)
    try:
        assert holding.wait(10)
        with transaction.atomic():
            second = outbox_claim_pending(queue="jobs", quotas={user.id: 10}, exclude=[])
    finally:
        release.set()
        thread.join(10)
    assert errors == []
    assert [m.id for m in first] == [rows[0].id, rows[1].id]
    assert [m.id for m in second] == [rows[2].id, rows[3].id]


@pytest.mark.django_db(transaction=True)
def test_a_cancel_discards_the_rows_no_relay_holds(bare_run, user):
    run = bare_run()
    held, free = _row(run, priority=9), _row(run)
    other = bare_run()
    _row(other)
    holding, release = threading.Event(), threading.Event()
    errors: list = []

    def claim_and_hold() -> None:
        with transaction.atomic():
            assert [m.id for m in outbox_claim_pending(
                queue="jobs", quotas={user.id: 1}, exclude=[]
            )] == [held.id]  # fmt: skip
            holding.set()
            release.wait(10)

    thread = in_thread(claim_and_hold, errors)
    try:
        assert holding.wait(10)
        with transaction.atomic():
            # The relay's row is sent (the worker refuses its claim); the other never is.
            assert outbox_discard_pending(run_id=run.id) == 1
    finally:
        release.set()
        thread.join(10)
    assert errors == []
    assert not OutboxMessage.objects.filter(id=free.id).exists()
    assert list(OutboxMessage.objects.filter(run=run).values_list("id", flat=True)) == [held.id]
    assert outbox_discard_pending(run_id=run.id) == 1
    assert not OutboxMessage.objects.filter(run=run).exists()
    assert OutboxMessage.objects.filter(run=other).count() == 1


def test_a_claim_is_a_lease_that_another_claim_takes_once_it_ran_out(bare_run):
    """A claimed row is passed over while its claim lasts and taken once it ran out; the
    first claimant then deletes or keeps nothing, and a failed try gives the claim up."""
    import uuid

    run = bare_run()
    row = _row(run)
    first, second = uuid.uuid4(), uuid.uuid4()
    owner = run.job.owner_id

    def claim(by) -> list[int]:
        rows = outbox_claim_pending(queue="jobs", quotas={owner: 5}, exclude=[], claim=by)
        return [m.id for m in rows]

    assert claim(first) == [row.id]
    row.refresh_from_db()
    assert row.claimed_by == first and row.claimed_until is not None
    assert claim(second) == []
    OutboxMessage.objects.filter(id=row.id).update(
        claimed_until=row.claimed_until - dt.timedelta(seconds=31)
    )  # the first claimant froze past its lease
    assert claim(second) == [row.id]
    assert outbox_claim_keep(message_ids=[row.id], claim=first) == []
    assert outbox_delete_published(message_ids=[row.id], claim=first) == []
    assert outbox_claim_keep(message_ids=[row.id], claim=second) == [row.id]
    outbox_record_failed_try(message_ids=[row.id], error="an outage")
    row.refresh_from_db()
    assert (row.claimed_by, row.claimed_until) == (None, None)
    assert claim(first) == [row.id]
    assert outbox_delete_published(message_ids=[row.id], claim=first) == [row.id]
