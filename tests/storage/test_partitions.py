"""storage.partitions against PostgreSQL: each operation, and the races of acquisition and
take-over on two real connections."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import pytest
from django.db import connection, connections, transaction

from jobs.models import PartitionLease, SchedulerReplica
from jobs.partitions import job_partition
from storage.partitions import (
    HolderLeases,
    Session,
    held_partitions_sql,
    in_held_partitions_sql,
    job_partition_sql,
    leases_acquire_free,
    leases_by_holder,
    leases_hand_over,
    leases_release,
    leases_renew,
    leases_step_down,
    leases_take_over_expired,
    replica_delete,
    replica_membership_renew,
    replica_session_record,
    replica_sessions_terminate,
    replicas_prune_and_list,
    session_current,
)
from tests.threads import in_thread, wait_for_lock_waiters

T0 = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def lease(partition: int, holder: str, expires: float) -> None:
    PartitionLease.objects.create(
        partition=partition, holder=holder, expires_at=at(expires), acquired_at=at(0)
    )


def held_by(holder: str) -> set[int]:
    return set(PartitionLease.objects.filter(holder=holder).values_list("partition", flat=True))


@pytest.mark.django_db
def test_a_membership_joins_renews_and_rejoins_after_expiring():
    session = Session(pid=4242, started_at=at(-100))
    assert replica_membership_renew(holder="a", now=at(0), until=at(10), session=session)
    assert not replica_membership_renew(holder="a", now=at(3), until=at(13), session=None)
    row = SchedulerReplica.objects.get(holder="a")
    # The session recorded first stays: renewals without one never erase it.
    assert (row.expires_at, row.session_pid, row.session_started_at) == (at(13), 4242, at(-100))
    assert replica_membership_renew(holder="a", now=at(20), until=at(30), session=None)


@pytest.mark.django_db
def test_stale_memberships_are_deleted_but_listed_once():
    replica_membership_renew(holder="gone", now=at(0), until=at(1), session=None)
    replica_membership_renew(holder="live", now=at(0), until=at(10), session=None)
    assert replicas_prune_and_list(stale_before=at(5)) == {"gone": at(1), "live": at(10)}
    assert replicas_prune_and_list(stale_before=at(5)) == {"live": at(10)}


@pytest.mark.django_db
def test_renew_step_down_and_count_leases():
    lease(0, "a", 10)
    lease(1, "a", 2)  # expired at 5
    lease(2, "a", 10)  # beyond a count of 2
    lease(3, "b", 8)
    assert leases_renew(holder="a", now=at(5), until=at(15), partitions=2) == {0}
    assert PartitionLease.objects.get(partition=0).expires_at == at(15)
    assert leases_step_down(holder="a", now=at(5), partitions=2) == 2  # 1 expired, 2 beyond
    assert held_by("a") == {0}
    assert leases_by_holder(now=at(5), partitions=4) == {
        "a": HolderLeases(1, at(15)),
        "b": HolderLeases(1, at(8)),
    }
    assert leases_by_holder(now=at(9), partitions=1) == {"a": HolderLeases(1, at(15))}


@pytest.mark.django_db
def test_hand_over_moves_only_live_leases_still_held_by_the_giver():
    lease(0, "a", 10)
    lease(1, "a", 2)  # expired: not the giver's to give
    lease(2, "c", 10)  # someone else's
    given = leases_hand_over(partitions=[0, 1, 2], from_holder="a", to_holder="b",
                             now=at(5), until=at(20))  # fmt: skip
    assert given == {0}
    assert held_by("b") == {0}
    assert PartitionLease.objects.get(partition=0).expires_at == at(20)


@pytest.mark.django_db
def test_acquire_free_then_take_over_expired():
    lease(0, "b", 2)  # expired at 5
    lease(1, "b", 10)
    assert leases_acquire_free(holder="a", want=10, now=at(5), until=at(15), partitions=4) == {
        2,
        3,
    }
    assert leases_take_over_expired(holder="a", want=5, now=at(5), until=at(15), partitions=4) == {
        0
    }
    assert held_by("a") == {0, 2, 3} and held_by("b") == {1}
    assert leases_acquire_free(holder="a", want=1, now=at(5), until=at(15), partitions=4) == set()


@pytest.mark.django_db
def test_release_and_delete_a_replica():
    lease(0, "a", 10)
    lease(1, "a", 10)
    replica_membership_renew(holder="a", now=at(0), until=at(10), session=None)
    assert leases_release(holder="a") == 2
    assert replica_delete(holder="a") == 1
    assert replica_delete(holder="a") == 0
    assert not PartitionLease.objects.exists() and not SchedulerReplica.objects.exists()


@pytest.mark.django_db
def test_the_calling_session_is_recorded_on_its_membership():
    assert replica_session_record(holder="a") is None  # no membership yet
    mine = session_current()
    replica_membership_renew(holder="a", now=at(0), until=at(10), session=None)
    assert replica_session_record(holder="a") == mine
    row = SchedulerReplica.objects.get(holder="a")
    assert (row.session_pid, row.session_started_at) == mine


@pytest.mark.django_db(transaction=True)
def test_only_an_expired_replicas_session_inside_a_transaction_is_ended():
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pid, backend_start FROM pg_stat_activity"
                           " WHERE pid = pg_backend_pid()")  # fmt: skip
            session = Session(*cursor.fetchone())
        replica_membership_renew(holder="b", now=at(0), until=at(1), session=session)
        # Idle (no transaction): left alone, even expired.
        assert replica_sessions_terminate(holders=["b"], now=at(5)) == 0
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("SELECT 1")  # inside a transaction now
        assert replica_sessions_terminate(holders=["b"], now=at(0.5)) == 0  # not expired yet
        assert replica_sessions_terminate(holders=["b"], now=at(5)) == 1
    finally:
        other.close()


@pytest.mark.django_db(transaction=True)
def test_a_stale_membership_whose_session_is_inside_a_transaction_stays_until_it_ends():
    """A replica frozen mid-pass, replaced long after its membership expired: the pruning
    keeps its membership (and so the session to end) however late the replacement comes."""
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("SELECT pid, backend_start FROM pg_stat_activity"
                           " WHERE pid = pg_backend_pid()")  # fmt: skip
            session = Session(*cursor.fetchone())  # inside a transaction from here
        replica_membership_renew(holder="frozen", now=at(0), until=at(1), session=session)
        replica_membership_renew(holder="idle", now=at(0), until=at(1), session=None)
        assert replicas_prune_and_list(stale_before=at(300)) == {"frozen": at(1), "idle": at(1)}
        assert replicas_prune_and_list(stale_before=at(300)) == {"frozen": at(1)}
        assert replica_sessions_terminate(holders=["frozen"], now=at(300)) == 1
        # pg_terminate_backend only signals: the session ends a moment later.
        for _ in range(100):
            if replicas_prune_and_list(stale_before=at(300)) == {}:
                break
            time.sleep(0.05)
        assert replicas_prune_and_list(stale_before=at(300)) == {}
    finally:
        other.close()


@pytest.mark.django_db(transaction=True)
def test_two_replicas_acquiring_at_once_take_different_partitions():
    """Both insert at once: each partition goes to one of them (ON CONFLICT DO NOTHING),
    and a second round takes what the collisions left."""
    barrier = threading.Barrier(2)
    gained: dict[str, set[int]] = {}
    errors: list = []

    def replica(holder: str) -> None:
        barrier.wait(10)
        for _ in range(3):
            gained.setdefault(holder, set()).update(
                leases_acquire_free(
                    holder=holder,
                    want=8 - len(gained.get(holder, ())),
                    now=at(0),
                    until=at(10),
                    partitions=16,
                )  # fmt: skip
            )

    threads = [in_thread(lambda name=name: replica(name), errors) for name in "ab"]
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert not gained["a"] & gained["b"]
    assert gained["a"] == held_by("a") and gained["b"] == held_by("b")
    for holder in "ab":  # a last round, alone: what the collisions left is free
        leases_acquire_free(holder=holder, want=8 - len(held_by(holder)), now=at(0),
                            until=at(10), partitions=16)  # fmt: skip
    assert len(held_by("a")) == len(held_by("b")) == 8


@pytest.mark.django_db(transaction=True)
def test_a_take_over_passes_by_an_expired_lease_another_is_taking():
    """One transaction holds an expired lease (taking it over, not committed yet): the
    other's take-over skips it (SKIP LOCKED) instead of waiting, and takes the other one."""
    lease(0, "gone", 2)
    lease(1, "gone", 2)
    locked, release = threading.Event(), threading.Event()
    taken: list[set[int]] = []

    def first() -> None:
        with transaction.atomic():
            taken.append(leases_take_over_expired(holder="a", want=1, now=at(5), until=at(15),
                                                  partitions=2))  # fmt: skip
            locked.set()
            release.wait(30)

    thread = in_thread(first)
    assert locked.wait(30)
    try:
        second = leases_take_over_expired(holder="b", want=2, now=at(5), until=at(15),
                                          partitions=2)  # fmt: skip
    finally:
        release.set()
        thread.join(30)
    assert len(taken[0]) == 1 and second == {0, 1} - taken[0]
    assert held_by("a") == taken[0] and held_by("b") == second


@pytest.mark.django_db(transaction=True)
def test_a_hand_over_waits_for_a_renewal_in_flight_and_then_gives_it():
    """A renewal holds the lease's row until it commits; a hand-over of it waits (it never
    gives a lease from under a statement that holds it), then moves the renewed lease."""
    lease(0, "a", 10)
    locked, release = threading.Event(), threading.Event()

    def renewing() -> None:
        with transaction.atomic():
            leases_renew(holder="a", now=at(5), until=at(15), partitions=1)
            locked.set()
            release.wait(30)

    thread = in_thread(renewing)
    assert locked.wait(30)
    given: list = []
    handing = in_thread(lambda: given.append(leases_hand_over(
        partitions=[0], from_holder="a", to_holder="b", now=at(8), until=at(22))))  # fmt: skip
    try:
        wait_for_lock_waiters(1)
    finally:
        release.set()
        thread.join(30)
        handing.join(30)
    assert given == [{0}] and held_by("b") == {0}


@pytest.mark.django_db
def test_the_partition_in_sql_is_the_partition_in_python():
    ids = [uuid.uuid4() for _ in range(50)] + [uuid.UUID(int=2**128 - 1), uuid.UUID(int=0)]
    with connection.cursor() as cursor:
        for job_id in ids:
            cursor.execute("SELECT " + job_partition_sql("%s::uuid"), [job_id, 7])
            assert cursor.fetchone()[0] == job_partition(job_id, 7)


@pytest.mark.django_db
def test_a_partition_is_held_only_under_a_live_lease_of_its_holder():
    PartitionLease.objects.create(partition=1, holder="me", acquired_at=T0,
                                  expires_at=dt.datetime(2999, 1, 1, tzinfo=dt.UTC))  # fmt: skip
    PartitionLease.objects.create(partition=2, holder="me", acquired_at=T0,
                                  expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))  # fmt: skip
    held = held_partitions_sql("%(holder)s", "%(count)s")
    condition = in_held_partitions_sql("%(partition)s", held)
    with connection.cursor() as cursor:
        for partition, holder, count, expected in (
            (1, "me", 4, True), (2, "me", 4, False), (1, "other", 4, False), (1, "me", 1, False),
        ):  # fmt: skip
            cursor.execute(
                "SELECT " + condition, {"partition": partition, "holder": holder, "count": count}
            )
            assert cursor.fetchone()[0] is expected, (partition, holder, count)
