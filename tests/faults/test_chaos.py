"""Chaos: processes SIGKILLed (and workers SIGSTOPped past their leases) at random while a
few hundred runs fall due, RabbitMQ and PostgreSQL each restarted once; afterwards the
invariant checker reads the database."""

import os
import random
import signal
import subprocess
import threading
import time

import pytest
from django.db import connection
from django.db.models import Count

from jobs.models import Counter, Run, RunState
from jobs.transitions import TERMINAL_RUN_STATES
from tests.factories import one_time_job
from tests.faults.helpers import counter, restarts_services
from tests.faults.invariants import invariant_violations
from tests.processes import wait_for

# RabbitMQ and PostgreSQL are each restarted once.
pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.drill, restarts_services]

RUNS = 300
DUE_OVER_SECONDS = 45
CHAOS_SECONDS = 45


def restart_rabbitmq() -> None:
    for action in ("stop_app", "start_app"):
        subprocess.run(["rabbitmqctl", "-q", action], check=True, capture_output=True, timeout=120)
    subprocess.run(["rabbitmqctl", "-q", "await_startup"], check=True, capture_output=True,
                   timeout=120)  # fmt: skip


def restart_postgresql() -> None:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    connection.close()  # this process's own connection died with the server


def _resume(stack, name: str, paused: set) -> None:
    if name in paused:  # not killed (and restarted) while it was frozen
        paused.discard(name)
        stack.signal_group(name, signal.SIGCONT)


def _database(call, *, timeout: float = 60.0):
    """Run a query through the restart window of the database."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except Exception:  # noqa: BLE001 - the server is still starting
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_chaos_kills_and_restarts_lose_nothing_and_double_nothing(stack, report_figure):
    rng = random.Random(int(os.environ.get("CHAOS_SEED", "20261129")))
    start = time.monotonic()
    jobs = [
        one_time_job(
            task="faults.work",
            due_in=5 + DUE_OVER_SECONDS * index / RUNS,
            args=[0.3],
            heartbeat_timeout_seconds=3,
            timeout_seconds=60,
            retry={"max_attempts": 10, "initial_delay_seconds": 0.2, "max_delay_seconds": 2},
        )
        for index in range(RUNS)
    ]
    fast_reconcile = ("--queued-after", "5", "--reconcile-interval", "1")
    for name in ("scheduler-a", "scheduler-b"):
        stack.scheduler(name, *fast_reconcile)
    for name in ("relay-a", "relay-b"):
        stack.relay(name)
    for name in ("worker-a", "worker-b"):
        stack.worker(name, concurrency=2)

    victims = sorted(stack.processes)
    kills: dict[str, int] = {}
    restarts = {"rabbitmq": False, "postgresql": False}
    chaos_started = time.monotonic()
    pauses: list[threading.Timer] = []
    paused: set[str] = set()
    while time.monotonic() - chaos_started < CHAOS_SECONDS:
        time.sleep(rng.uniform(2, 4))
        victim = rng.choice(victims)
        kind = victim.split("-")[0]
        if kind == "worker" and victim not in paused and rng.random() < 0.4:
            # Frozen past its lease (3 s), then resumed: its late writes must be refused.
            stack.signal_group(victim, signal.SIGSTOP)
            paused.add(victim)
            timer = threading.Timer(rng.uniform(5, 8), _resume, (stack, victim, paused))
            timer.start()
            pauses.append(timer)
        else:
            stack.kill(victim)
            paused.discard(victim)
            kills[kind] = kills.get(kind, 0) + 1
            stack.restart(victim)  # as a supervisor (systemd, Kubernetes) would
        elapsed = time.monotonic() - chaos_started
        if elapsed > 12 and not restarts["rabbitmq"]:
            restart_rabbitmq()
            restarts["rabbitmq"] = True
        if elapsed > 35 and not restarts["postgresql"]:
            restart_postgresql()
            restarts["postgresql"] = True
    for timer in pauses:
        timer.join()
    faults_ended = time.monotonic()

    for name, process in stack.processes.items():
        if process.poll() is not None:  # a process that exited on its own is a finding
            pytest.fail(f"{name} exited with {process.returncode}: {stack.log(name)[-3000:]!r}")
    wait_for(
        lambda: _database(
            lambda: (
                Run.objects.count() == RUNS
                and not Run.objects.exclude(state__in=TERMINAL_RUN_STATES).exists()
            )
        ),
        timeout=240,
        interval=1,
        message="every run to reach a terminal state",
    )
    quiesced = time.monotonic() - faults_ended

    assert invariant_violations() == []
    assert {run.job_id for run in Run.objects.all()} == {job.id for job in jobs}
    states = dict(Run.objects.values_list("state").annotate(n=Count("id")))
    duplicates = counter("scheduler_duplicate_deliveries_total")
    stale = sum(
        Counter.objects.filter(name="scheduler_stale_completions_total").values_list(
            "value", flat=True
        )
    )
    repairs = sum(
        Counter.objects.filter(name="scheduler_reconcile_repairs_total").values_list(
            "value", flat=True
        )
    )
    report_figure(
        f"{RUNS} runs due over {DUE_OVER_SECONDS}s; {sum(kills.values())} SIGKILLs {kills}, "
        f"{len(pauses)} workers SIGSTOPped for 5-8 s, "
        f"RabbitMQ and PostgreSQL restarted once each; states {states}; "
        f"leases expired {counter('scheduler_lease_expired_total')}, duplicate deliveries "
        f"refused {duplicates}, stale writes refused {stale}, reconciliation repairs {repairs}; "
        f"quiesced {quiesced:.1f}s after the last fault "
        f"(whole test {time.monotonic() - start:.0f}s)"
    )
    assert states == {RunState.SUCCEEDED: RUNS}
