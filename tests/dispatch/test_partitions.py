"""Partition leases (dispatch.partitions), one pass at a time with a pinned clock: acquiring,
the fair share with one, two and three replicas, the surplus handed over without an unheld
moment, expired leases taken over, stepping down when renewal fails, release; and the
scheduler's claims (materializer, promoter, next due instant) kept to the partitions a
replica holds on the database's clock."""

import datetime as dt

import pytest
from django.db.models import Count

from dispatch.materializer import MaterializerConfig, materializer_run_once
from dispatch.partitions import (
    PartitionKeeper,
    PartitionsConfig,
    partitions_release,
    partitions_run_once,
)
from dispatch.promoter import PromoterConfig, promoter_run_once
from dispatch.scheduler import scheduler_next_due
from jobs.clock import db_now
from jobs.models import Job, PartitionLease, Run, RunState, SchedulerReplica
from jobs.partitions import JobPartition, PartitionScope, job_partition

NOW = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)
LEASE = 10.0


def config(holder: str, partitions: int = 64, lease: float = LEASE) -> PartitionsConfig:
    return PartitionsConfig(holder=holder, partitions=partitions, lease_seconds=lease)


def at(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


def holdings(now: dt.datetime) -> dict[str, int]:
    """Holder -> partitions whose lease it holds at `now`."""
    return dict(
        PartitionLease.objects.filter(expires_at__gte=now)
        .values_list("holder")
        .annotate(n=Count("partition"))
    )


def once(holder: str, now: dt.datetime, **kwargs):
    return partitions_run_once(now=now, config=config(holder, **kwargs))


@pytest.mark.django_db
def test_a_replica_alone_acquires_every_partition_then_renews_them():
    first = once("a", at(0))
    assert (first.joined, first.replicas, first.share) == (True, 1, 64)
    assert (first.acquired, first.held) == (64, 64)
    assert holdings(at(0)) == {"a": 64}

    second = once("a", at(3))
    assert (second.joined, second.renewed, second.acquired, second.held) == (False, 64, 0, 64)
    assert set(PartitionLease.objects.values_list("expires_at", flat=True)) == {at(3 + LEASE)}
    assert SchedulerReplica.objects.get(holder="a").expires_at == at(3 + LEASE)


@pytest.mark.django_db
def test_fair_shares_with_one_two_and_three_replicas_without_an_unheld_moment():
    once("a", at(0))
    assert holdings(at(0)) == {"a": 64}

    joined = once("b", at(1))  # nothing is free: it joins and waits for a hand-over
    assert (joined.joined, joined.replicas, joined.share, joined.held) == (True, 2, 32, 0)
    handed = once("a", at(1.1))
    assert (handed.replicas, handed.share, handed.handed_over, handed.held) == (2, 32, 32, 32)
    # The holder changed in place: every partition stayed held throughout.
    assert holdings(at(1.1)) == {"a": 32, "b": 32}

    assert once("c", at(2)).share == 22
    for holder in ("a", "b", "c"):  # each renews and gives its surplus to c
        once(holder, at(2.1))
        assert sum(holdings(at(2.1)).values()) == 64
    assert holdings(at(2.1)) == {"a": 22, "b": 22, "c": 20}
    assert once("c", at(3)).held == 20  # at most a share each; all 64 held


@pytest.mark.django_db
def test_a_replica_never_takes_more_than_its_share_of_free_partitions():
    once("a", at(0), partitions=8)
    once("b", at(0.1), partitions=8)
    partitions_release(holder="a")  # a stops: eight partitions free
    SchedulerReplica.objects.create(holder="c", expires_at=at(LEASE), joined_at=at(0))
    result = once("b", at(0.2), partitions=8)
    assert (result.replicas, result.share, result.held) == (2, 4, 4)
    assert holdings(at(0.2)) == {"b": 4}  # the other four wait for c (or c's expiry)


@pytest.mark.django_db
def test_a_dead_replicas_expired_leases_are_taken_over_and_its_return_is_shared():
    once("a", at(0))
    once("b", at(0.1))
    once("a", at(0.2))  # 32 each
    assert holdings(at(0.2)) == {"a": 32, "b": 32}

    # b dies (or is paused): a renews, and the wake-up is b's expiry.
    renewed = once("a", at(3))
    assert renewed.next_expiry_seconds == pytest.approx(0.1 + LEASE - 3)
    taken = once("a", at(0.2 + LEASE + 0.05))  # b's leases and membership have expired
    assert (taken.replicas, taken.share, taken.acquired, taken.held) == (1, 64, 32, 64)

    back = once("b", at(20))  # b resumes: its renewal fails, it rejoins with nothing
    assert (back.joined, back.renewed, back.stepped_down, back.held) == (True, 0, 0, 0)
    once("a", at(20.1))
    assert holdings(at(20.1)) == {"a": 32, "b": 32}


@pytest.mark.django_db
def test_a_replica_steps_down_from_leases_it_could_not_renew():
    once("a", at(0), partitions=8)
    late = once("a", at(LEASE + 1), partitions=8)  # paused past its leases' expiry
    assert (late.renewed, late.stepped_down) == (0, 8)
    assert late.acquired == 8  # free again, and nobody else wants them: acquired anew
    assert set(PartitionLease.objects.values_list("acquired_at", flat=True)) == {at(LEASE + 1)}


@pytest.mark.django_db
def test_no_partition_is_handed_to_a_replica_that_stopped_renewing():
    once("a", at(0), partitions=8)
    # b joined a while ago and has not renewed since: it may be paused.
    SchedulerReplica.objects.create(holder="b", expires_at=at(LEASE * 0.4), joined_at=at(-6))
    result = once("a", at(0.1), partitions=8)
    assert (result.replicas, result.share, result.handed_over, result.held) == (2, 4, 0, 8)


@pytest.mark.django_db
def test_release_frees_every_lease_and_the_membership():
    once("a", at(0), partitions=8)
    assert partitions_release(holder="a") == 8
    assert not PartitionLease.objects.exists() and not SchedulerReplica.objects.exists()
    assert once("b", at(0.1), partitions=8).acquired == 8


@pytest.mark.django_db
def test_fewer_partitions_after_a_restart_release_the_ones_beyond_the_count():
    once("a", at(0), partitions=8)
    result = once("a", at(1), partitions=4)
    assert (result.renewed, result.stepped_down, result.held) == (4, 4, 4)
    assert sorted(PartitionLease.objects.values_list("partition", flat=True)) == [0, 1, 2, 3]


def test_the_sleep_is_a_third_of_the_lease_or_until_another_replica_expires():
    keeper = PartitionKeeper(config("a", lease=9.0), listener=None)
    from dispatch.partitions import PartitionsResult

    assert keeper.sleep_seconds(PartitionsResult()) == 3.0
    assert keeper.sleep_seconds(PartitionsResult(next_expiry_seconds=1.0)) == pytest.approx(1.05)
    with pytest.raises(ValueError, match="lease_seconds must be greater than 0"):
        config("a", lease=0)
    with pytest.raises(ValueError, match="partitions must be at least 1"):
        config("a", partitions=0)


@pytest.mark.django_db
def test_the_partition_in_sql_is_the_one_in_python(make_job):
    jobs = [make_job(now=NOW, name=f"job {index}") for index in range(20)]
    for count in (1, 7, 64):
        in_sql = dict(Job.objects.annotate(p=JobPartition("id", count)).values_list("id", "p"))
        assert in_sql == {job.id: job_partition(job.id, count) for job in jobs}


def due_jobs(make_job, count: int) -> list[Job]:
    return [
        make_job(now=NOW, name=f"due {index}", schedule={"kind": "once", "run_at": NOW.isoformat()})
        for index in range(count)
    ]


def hold(holder: str, partitions: list[int], *, expires_in: float) -> None:
    """Leases on the database's clock (the claims compare with it, not with NOW)."""
    now = db_now()
    for partition in partitions:
        PartitionLease.objects.create(
            partition=partition, holder=holder, acquired_at=now,
            expires_at=now + dt.timedelta(seconds=expires_in),
        )  # fmt: skip


@pytest.mark.django_db
def test_the_materializer_claims_only_the_partitions_held(make_job):
    jobs = due_jobs(make_job, 24)
    hold("a", [0, 1], expires_in=60)
    hold("b", [2, 3], expires_in=60)
    scope = PartitionScope(holder="a", partitions=4)

    result = materializer_run_once(now=NOW, config=MaterializerConfig(scope=scope))

    mine = {job.id for job in jobs if job_partition(job.id, 4) in (0, 1)}
    assert set(Run.objects.values_list("job_id", flat=True)) == mine
    assert result.runs_created == len(mine) and 0 < len(mine) < len(jobs)


@pytest.mark.django_db
def test_a_replica_whose_leases_expired_claims_nothing_until_it_holds_them_again(make_job):
    due_jobs(make_job, 5)
    lapsed = config("a", partitions=4, lease=2.0)
    # Its last renewal was long ago on the database's clock (a SIGSTOP, a stalled thread):
    # its rows still name it, but the claim's own statement sees them expired.
    partitions_run_once(now=db_now() - dt.timedelta(seconds=3), config=lapsed)
    assert PartitionLease.objects.filter(holder="a").count() == 4
    scope = lapsed.scope
    assert materializer_run_once(now=NOW, config=MaterializerConfig(scope=scope)).runs_created == 0
    assert scheduler_next_due(now=NOW, scope=scope) is None

    assert partitions_run_once(now=db_now(), config=lapsed).held == 4
    assert materializer_run_once(now=NOW, config=MaterializerConfig(scope=scope)).runs_created == 5


@pytest.mark.django_db
def test_the_promoter_and_the_next_due_instant_keep_to_the_partitions_held(make_job):
    jobs = due_jobs(make_job, 16)
    materializer_run_once(now=NOW, config=MaterializerConfig())  # unpartitioned: all queued
    Run.objects.update(state=RunState.RETRY_WAIT, next_attempt_at=at(5))
    Job.objects.update(next_run_at=at(60), state="active")
    hold("a", [0], expires_in=60)
    scope = PartitionScope(holder="a", partitions=2)
    mine = {job.id for job in jobs if job_partition(job.id, 2) == 0}
    first_mine = at(30)
    Job.objects.filter(id__in=mine).update(next_run_at=first_mine)
    Job.objects.exclude(id__in=mine).update(next_run_at=at(10))  # others' come first

    assert scheduler_next_due(now=NOW, scope=scope) == at(5)  # its retries
    result = promoter_run_once(now=at(6), config=PromoterConfig(scope=scope))
    assert result.retries_queued == len(mine)
    queued = set(Run.objects.filter(state=RunState.QUEUED).values_list("job_id", flat=True))
    assert queued == mine
    assert scheduler_next_due(now=at(6), scope=scope) == first_mine  # not others' at(10)
    assert scheduler_next_due(now=at(6)) == at(5)  # unpartitioned: everyone's


@pytest.mark.django_db(transaction=True)
def test_replicas_starting_together_share_every_partition_without_waiting_on_each_other():
    """Three first passes at once, each on its own connection, then renewals at once, then
    passes after every lease expired: no deadlock, every partition held once (the primary
    key), none beyond a replica's share."""
    import threading

    from django.db import connections

    barrier = threading.Barrier(3)
    errors = []

    def replica(holder: str) -> None:
        try:
            barrier.wait(10)
            once(holder, at(0))
            barrier.wait(10)
            once(holder, at(1))
            barrier.wait(10)
            once(holder, at(30))  # every lease expired: all step down and race again
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=replica, args=(name,)) for name in "abc"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    for holder in "abc":  # a last round: each takes what the collisions left
        once(holder, at(31))
    held = holdings(at(31))
    assert sum(held.values()) == 64 and max(held.values()) <= 22, held


@pytest.mark.django_db(transaction=True)
def test_taking_over_a_frozen_replicas_leases_ends_its_session_and_frees_its_jobs(make_job):
    """b froze in the middle of a pass, its claimed job locked: the replica that takes b's
    expired leases over ends b's recorded session, so the job is claimed at once rather
    than skipped (SKIP LOCKED) for as long as b stays frozen."""
    from django.db import DatabaseError, connections

    from tests.processes import wait_for

    (job,) = due_jobs(make_job, 1)
    frozen = connections.create_connection("default")  # b's scheduler session
    try:
        with frozen.cursor() as cursor:
            cursor.execute(
                "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            )
            session = cursor.fetchone()
        lapsed = config("b", partitions=4, lease=2.0)
        partitions_run_once(now=db_now() - dt.timedelta(seconds=3), config=lapsed, session=session)
        frozen.set_autocommit(False)
        with frozen.cursor() as cursor:  # its pass claimed the job, then b froze
            cursor.execute("SELECT id FROM jobs_job WHERE id = %s FOR UPDATE", [job.id])

        result = partitions_run_once(now=db_now(), config=config("a", partitions=4))

        assert (result.acquired, result.sessions_ended) == (4, 1)
        claim = MaterializerConfig(scope=PartitionScope(holder="a", partitions=4))
        wait_for(
            lambda: materializer_run_once(now=NOW, config=claim).runs_created == 1,
            timeout=10,
            interval=0.05,
            message="the job b had locked to be claimed by a",
        )
        with pytest.raises(DatabaseError):  # b, resumed, finds its session ended
            with frozen.cursor() as cursor:
                cursor.execute("SELECT 1")
    finally:
        frozen.close()


@pytest.mark.django_db
def test_a_replica_that_still_renews_its_membership_keeps_its_session(make_job):
    """Its leases expired (a stalled lease loop) but it is alive: only its partitions move."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
        session = cursor.fetchone()
    partitions_run_once(now=db_now() - dt.timedelta(seconds=3), config=config("b", 4, 2.0),
                        session=session)  # fmt: skip
    SchedulerReplica.objects.filter(holder="b").update(
        expires_at=db_now() + dt.timedelta(seconds=60)
    )
    result = partitions_run_once(now=db_now(), config=config("a", partitions=4))
    assert (result.acquired, result.sessions_ended) == (2, 0)  # a's share of two replicas


@pytest.mark.django_db
def test_a_refusal_to_end_a_gone_replicas_session_costs_no_lease(monkeypatch):
    """Schedulers on database roles without pg_signal_backend: pg_terminate_backend is
    refused (stood in for here, since the tests' role is a superuser); the pass still
    renews and takes over, it only leaves the frozen session alone."""
    from django.db import connection

    import dispatch.partitions

    once("a", at(0), partitions=4)
    once("b", at(0), partitions=4)
    once("a", at(0), partitions=4)  # hands b its half
    assert holdings(at(0)) == {"a": 2, "b": 2}
    SchedulerReplica.objects.filter(holder="b").update(
        session_pid=1, session_started_at=at(0), expires_at=at(1)
    )
    PartitionLease.objects.filter(holder="b").update(expires_at=at(1))  # b froze at once

    def refused(**_):
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")  # a real error of the database, in the pass's session

    monkeypatch.setattr(dispatch.partitions, "replica_sessions_terminate", refused)
    result = once("a", at(5), partitions=4)
    assert (result.renewed, result.acquired, result.sessions_ended) == (2, 2, 0)
    assert holdings(at(5)) == {"a": 4}
