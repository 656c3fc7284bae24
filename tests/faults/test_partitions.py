"""Partition leases moving while dispatch goes on: three scheduler replicas share 300
one-time runs due across 45 s; one is SIGKILLed, one SIGSTOPped for 20 s (then resumed),
and a fourth joins meanwhile. Every run is created once and runs once, none created later
than one lease period (plus a few seconds) after it was due, and the survivors end up
sharing the partitions fairly."""

import datetime as dt
import signal
import statistics
import threading
import time

import pytest
from django.db.models import Count

from jobs.models import PartitionLease, Run, SchedulerReplica
from jobs.transitions import TERMINAL_RUN_STATES
from tests.factories import one_time_job
from tests.faults.invariants import invariant_violations
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]

RUNS = 300
DUE_OVER_SECONDS = 45
LEASE_SECONDS = 5
PARTITIONS = 64
# Past the lease period: the takeover pass (woken at the expiry), the scheduler's pass it
# wakes, and a loaded shared box.
LATENESS_MARGIN_SECONDS = 3.0


def holdings() -> dict[str, int]:
    """Holder -> partitions it holds now (on the database's clock)."""
    from django.db.models.functions import Now

    return dict(
        PartitionLease.objects.filter(expires_at__gt=Now())
        .values_list("holder")
        .annotate(n=Count("partition"))
    )


def holder_of(stack, name: str) -> str:
    """The holder name of a scheduler process (host:pid:suffix)."""
    pid = stack.processes[name].pid
    return wait_for(
        lambda: (
            SchedulerReplica.objects.filter(holder__contains=f":{pid}:")
            .values_list("holder", flat=True)
            .first()
        ),
        timeout=30,
        message=f"{name} to join",
    )


def test_replicas_killed_paused_and_added_dispatch_every_run_once_and_in_time(stack, report_figure):
    lease = ("--partition-lease-seconds", str(LEASE_SECONDS))
    for name in ("scheduler-a", "scheduler-b", "scheduler-c"):
        stack.scheduler(name, *lease, SCHEDULER_PARTITIONS=str(PARTITIONS))
    stack.relay()
    for name in ("worker-a", "worker-b"):
        stack.worker(name, concurrency=2)
    holders = {
        name: holder_of(stack, name) for name in ("scheduler-a", "scheduler-b", "scheduler-c")
    }
    wait_for(
        lambda: (
            (held := holdings()).keys() == set(holders.values())
            and sum(held.values()) == PARTITIONS
            and max(held.values()) <= -(-PARTITIONS // 3)
        ),
        timeout=30,
        message="three replicas to share the partitions",
    )

    base = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    jobs = [
        one_time_job(
            task="faults.work",
            due_at=base + dt.timedelta(seconds=DUE_OVER_SECONDS * index / RUNS),
            args=[0.05],
        )
        for index in range(RUNS)
    ]
    started = time.monotonic() - (dt.datetime.now(dt.UTC) - base).total_seconds()

    def at(seconds: float) -> None:
        """Sleep until `seconds` after the first run is due."""
        time.sleep(max(0.0, started + seconds - time.monotonic()))

    at(8)
    stack.kill("scheduler-a")
    at(15)
    stack.signal_group("scheduler-b", signal.SIGSTOP)
    resume = threading.Timer(20, stack.signal_group, ("scheduler-b", signal.SIGCONT))
    resume.start()
    at(20)
    stack.scheduler("scheduler-d", *lease, SCHEDULER_PARTITIONS=str(PARTITIONS))
    resume.join()

    wait_for(
        lambda: Run.objects.filter(state__in=TERMINAL_RUN_STATES).count() >= RUNS,
        timeout=120,
        interval=1,
        message="every run to finish",
    )
    for name in ("scheduler-b", "scheduler-c", "scheduler-d"):
        assert stack.processes[name].poll() is None, stack.log(name)[-3000:]

    assert invariant_violations() == []
    per_job = dict(Run.objects.values_list("job_id").annotate(n=Count("id")))
    assert per_job == {job.id: 1 for job in jobs}  # one run per job, none missing
    runs = list(Run.objects.all())
    lateness = sorted((run.created_at - run.due_at).total_seconds() for run in runs)
    worst = lateness[-1]
    assert worst <= LEASE_SECONDS + LATENESS_MARGIN_SECONDS, lateness[-10:]

    # The survivors (b back from its pause, c, d) share the partitions, a's expired.
    survivors = {holder_of(stack, name) for name in ("scheduler-b", "scheduler-c", "scheduler-d")}
    wait_for(
        lambda: (
            (held := holdings()).keys() == survivors
            and sum(held.values()) == PARTITIONS
            and max(held.values()) <= -(-PARTITIONS // 3)
        ),
        timeout=3 * LEASE_SECONDS,
        message="the three live replicas to share the partitions fairly",
    )
    report_figure(
        f"{RUNS} runs due over {DUE_OVER_SECONDS}s, lease {LEASE_SECONDS}s, one scheduler "
        f"SIGKILLed, one SIGSTOPped 20s, one added: run created after due p50 "
        f"{statistics.median(lateness) * 1000:.0f} ms, p99 "
        f"{lateness[int(0.99 * RUNS) - 1]:.2f}s, max {worst:.2f}s; final shares "
        f"{sorted(holdings().values())}"
    )


def test_a_replica_stopped_with_sigterm_hands_its_partitions_over_at_once(stack, report_figure):
    """SIGTERM releases the leases and wakes the others: the partitions move in far less
    than the lease period (60 s here, so an expiry cannot be what moved them)."""
    lease = ("--partition-lease-seconds", "60")
    stack.scheduler("scheduler-a", *lease)
    first = holder_of(stack, "scheduler-a")
    # Alone, it holds every partition from its first pass.
    wait_for(lambda: holdings() == {first: PARTITIONS}, timeout=10, message="a to hold all")
    stack.scheduler("scheduler-b", *lease)
    second = holder_of(stack, "scheduler-b")
    joined_at = time.monotonic()
    wait_for(
        lambda: holdings() == {first: PARTITIONS // 2, second: PARTITIONS // 2},
        timeout=10,
        interval=0.05,
        message="a to hand half over to b",
    )
    shared = time.monotonic() - joined_at

    stopped_at = time.monotonic()
    assert stack.stop("scheduler-a") == 0, stack.log("scheduler-a")[-3000:]
    wait_for(lambda: holdings() == {second: PARTITIONS}, timeout=10, interval=0.05,
             message="b to take a's partitions over")  # fmt: skip
    moved = time.monotonic() - stopped_at
    assert moved < 10  # not the lease's 60 s
    assert not SchedulerReplica.objects.filter(holder=first).exists()
    assert b"released 32 partition leases" in stack.log("scheduler-a")
    report_figure(
        f"lease 60 s: a joining replica had its half {shared:.2f}s after its membership "
        f"showed; a SIGTERMed one's half had moved {moved:.2f}s after it exited"
    )


def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_replica_frozen_with_claimed_jobs_locked_loses_them_with_its_leases(stack, report_figure):
    """scheduler-a freezes (SIGSTOP, by a failpoint) right after its claim, the due jobs of
    its partitions locked in its open transaction. scheduler-b takes a's partitions over as
    its leases expire and ends a's session, so those jobs get their runs from b within a
    lease period; a is never resumed."""
    lease = ("--partition-lease-seconds", str(LEASE_SECONDS))
    stack.scheduler("scheduler-a", *lease, SCHEDULER_FAILPOINTS="materializer.after_claim=stop")
    stack.scheduler("scheduler-b", *lease)
    first, second = holder_of(stack, "scheduler-a"), holder_of(stack, "scheduler-b")
    wait_for(
        lambda: holdings() == {first: PARTITIONS // 2, second: PARTITIONS // 2},
        timeout=10,
        message="two replicas to share the partitions",
    )
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    jobs = [one_time_job(task="faults.work", due_at=due) for _ in range(20)]

    wait_for(lambda: _state(stack.processes["scheduler-a"].pid) == "T", timeout=20,
             message="scheduler-a to freeze with its claim")  # fmt: skip
    wait_for(
        lambda: Run.objects.count() == len(jobs),
        timeout=LEASE_SECONDS + 15,
        interval=0.1,
        message="every job's run, a's included",
    )
    assert _state(stack.processes["scheduler-a"].pid) == "T"  # still frozen throughout
    stack.kill("scheduler-a")  # a SIGTERM would wait for a SIGCONT
    assert b"ended 1 scheduler sessions" in stack.log("scheduler-b")
    per_job = dict(Run.objects.values_list("job_id").annotate(n=Count("id")))
    assert per_job == {job.id: 1 for job in jobs}
    lateness = max((run.created_at - run.due_at).total_seconds() for run in Run.objects.all())
    assert lateness <= LEASE_SECONDS + LATENESS_MARGIN_SECONDS
    report_figure(
        f"a replica frozen with its claim locked, lease {LEASE_SECONDS}s: its jobs' runs "
        f"created by the other at most {lateness:.2f}s after due"
    )


# A replacement (a pod restarted) comes this long after the replica froze: past one lease
# period of its membership's expiry, when the memberships' pruning deletes it.
REPLACED_AFTER_SECONDS = 30


def test_a_replica_frozen_with_claimed_jobs_locked_and_replaced_late_loses_them(
    stack, report_figure
):
    """scheduler-a, alone, freezes right after its claim with the due jobs locked in its
    open transaction; scheduler-b starts 30 s later (a pod restarted), long after a's
    membership expired. b ends a's session with its first pass, so the locked jobs run
    within a lease period of b's joining, not when PostgreSQL's idle-in-transaction timeout
    (600 s) ends the session."""
    lease = ("--partition-lease-seconds", str(LEASE_SECONDS))
    stack.scheduler("scheduler-a", *lease, SCHEDULER_FAILPOINTS="materializer.after_claim=stop")
    stack.relay()
    stack.worker("worker", concurrency=2)
    first = holder_of(stack, "scheduler-a")
    wait_for(lambda: holdings() == {first: PARTITIONS}, timeout=10, message="a to hold all")
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    jobs = [one_time_job(task="faults.work", due_at=due, args=[0.05]) for _ in range(10)]
    wait_for(lambda: _state(stack.processes["scheduler-a"].pid) == "T", timeout=20,
             message="scheduler-a to freeze with its claim")  # fmt: skip
    time.sleep(REPLACED_AFTER_SECONDS)
    assert not Run.objects.exists()  # a's claim is locked in its frozen session

    stack.scheduler("scheduler-b", *lease)
    second = holder_of(stack, "scheduler-b")
    joined_at = SchedulerReplica.objects.get(holder=second).joined_at
    wait_for(
        lambda: Run.objects.filter(state__in=TERMINAL_RUN_STATES).count() == len(jobs),
        timeout=LEASE_SECONDS + 30,
        interval=0.1,
        message="every job's run to finish, a's locked ones included",
    )
    assert _state(stack.processes["scheduler-a"].pid) == "T"  # still frozen throughout
    stack.kill("scheduler-a")
    assert b"ended 1 scheduler sessions" in stack.log("scheduler-b")
    per_job = dict(Run.objects.values_list("job_id").annotate(n=Count("id")))
    assert per_job == {job.id: 1 for job in jobs}
    assert invariant_violations() == []
    started = [run.started_at for run in Run.objects.all()]
    after_takeover = max((at - joined_at).total_seconds() for at in started)
    assert after_takeover <= LEASE_SECONDS
    report_figure(
        f"a lone replica frozen with its claim locked, replaced {REPLACED_AFTER_SECONDS}s "
        f"later, lease {LEASE_SECONDS}s: its jobs ran at most {after_takeover:.2f}s after "
        f"the replacement joined"
    )
