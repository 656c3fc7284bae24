"""The soak: the production shape (a three-node RabbitMQ cluster with quorum queues, a
PostgreSQL primary with a synchronous standby: tests/faults/machines.py, built on this
machine on ports of their own) under a steady rate of one-time jobs for `--minutes`, with a
fault every `--fault-every` seconds, in turn: a worker, a relay, a scheduler SIGKILLed
(and started again), a broker node stopped and started. At the end, once every run has
settled, the invariants: lost 0 (every job has its run, every run terminal), doubled 0 (no
run with two committed effects or two successes: tests/faults/invariants.py), the tables
bounded (nothing left in the outbox or the active runs), and the runs' lateness (first
claim minus due time) inside and outside the fault windows.

    python -m bench.soak --minutes 60                  # an hour, a fault every 3 minutes
    python -m bench.soak --minutes 5 --fault-every 40  # a short proof

Writes var/bench/<UTC>-soak.json and prints the figures."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, quantile, results_header, results_path
from tests.faults import machines

SETTLE_SECONDS = 30  # after a fault's end, the window in which lateness is the fault's
FAULTS = ("worker", "relay", "scheduler", "broker")


class Processes:
    """The product's processes, each in a session of its own (so SIGKILL takes a worker's
    pool too), restartable with the command line they were started with."""

    def __init__(self, env: dict, workdir: Path) -> None:
        self.env, self.workdir = env, workdir
        self.argv: dict[str, list[str]] = {}
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str] | None = None) -> None:
        argv = argv or self.argv[name]
        self.argv[name] = argv
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115
        self.running[name] = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**self.env, "SCHEDULER_DB_APPLICATION_NAME": name},
        )  # fmt: skip
        log.close()

    def kill(self, name: str) -> None:
        process = self.running[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def stop_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def _spec(name: str, due: dt.datetime) -> dict:
    from jobs.api.validation import JobSpecSerializer

    spec = JobSpecSerializer(
        data={
            "name": name,
            "task": "faults.work",
            "args": [0.05],
            "schedule": {"kind": "once", "run_at": due.isoformat()},
            "heartbeat_timeout_seconds": 5,
            "retry": {"max_attempts": 10, "initial_delay_seconds": 1, "max_delay_seconds": 5},
        }
    )
    spec.is_valid(raise_exception=True)
    return dict(spec.validated_data)


def _fault(kind: str, processes: Processes, cluster: machines.RabbitCluster, turn: int) -> None:
    """One fault, over when this returns (the victim started again)."""
    if kind == "broker":
        node = cluster.nodes[turn % len(cluster.nodes)]
        node.stop()
        time.sleep(15)
        node.start()
        node.await_startup()
        return
    victim = f"{kind}{turn % 2 + 1}"
    processes.kill(victim)
    time.sleep(2)
    processes.start(victim)


def _settled(timeout: float) -> bool:
    """Every job has its run and every run is terminal, twice in a row (a run claimed
    between two reads is not taken for settled)."""
    from django.db import connection

    from jobs.models import Job, Run
    from jobs.transitions import TERMINAL_RUN_STATES

    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        try:
            done = Run.objects.count() >= Job.objects.count() and not (
                Run.objects.exclude(state__in=TERMINAL_RUN_STATES).exists()
            )
        except Exception:  # noqa: BLE001 - the database is reconnecting
            connection.close()
            done = False
        quiet = quiet + 1 if done else 0
        if quiet >= 2:
            return True
        time.sleep(2)
    return False


def _figures(*, windows: list[tuple[float, float]], created: int) -> dict:
    from django.db import connection
    from django.db.models import Count, Min

    from jobs.models import (
        ActiveRun,
        Attempt,
        AttemptState,
        Counter,
        Job,
        OutboxMessage,
        Run,
        RunState,
    )
    from jobs.transitions import TERMINAL_RUN_STATES
    from tests.fault_tasks import EFFECT_COUNTER
    from tests.faults.invariants import invariant_violations

    problems = invariant_violations()
    runs = Run.objects.count()
    first_claims = Run.objects.annotate(claimed=Min("attempts__started_at")).values_list(
        "due_at", "claimed"
    )
    inside, outside = [], []
    for due, claimed in first_claims:
        if claimed is None:
            continue
        lateness = (claimed - due).total_seconds()
        at = due.timestamp()
        hit = any(start <= at <= end + SETTLE_SECONDS for start, end in windows)
        (inside if hit else outside).append(lateness)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, n_live_tup FROM pg_stat_user_tables WHERE n_live_tup > 0 "
            "ORDER BY n_live_tup DESC"
        )
        tables = dict(cursor.fetchall())
    states = dict(Run.objects.values_list("state").annotate(n=Count("id")))
    return {
        "jobs_created": created,
        "jobs_found": Job.objects.count(),
        "runs": runs,
        "states": states,
        # Accepted but never run to a terminal state; failed runs (out of attempts) apart.
        "lost": created - runs + Run.objects.exclude(state__in=TERMINAL_RUN_STATES).count(),
        "failed": Run.objects.filter(state=RunState.FAILED).count(),
        "doubled": Counter.objects.filter(name=EFFECT_COUNTER, value__gt=1).count()
        + Attempt.objects.filter(state=AttemptState.SUCCEEDED)
        .values("run_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .count(),
        "violations": len(problems),
        "violations_sample": problems[:10],
        "outbox_rows": OutboxMessage.objects.count(),
        "active_runs": ActiveRun.objects.count(),
        "table_rows": tables,
        "lateness_outside_faults": {
            "runs": len(outside),
            "p50": quantile(outside, 0.5),
            "p99": quantile(outside, 0.99),
            "max": max(outside, default=None),
        },
        "lateness_inside_faults": {
            "runs": len(inside),
            "p50": quantile(inside, 0.5),
            "p99": quantile(inside, 0.99),
            "max": max(inside, default=None),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--rate", type=float, default=5.0, help="jobs created a second")
    parser.add_argument("--fault-every", type=float, default=180, help="seconds between faults")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    started = dt.datetime.now(dt.UTC)
    reason = machines.available()
    if reason:
        raise SystemExit(f"cannot build the machines here: {reason}")
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    with machines.machines() as (cluster, pair):
        env = {
            **os.environ,
            "DATABASE_URL": pair.url(),
            "CELERY_BROKER_URL": cluster.url,
            "SCHEDULER_QUEUE_TYPE": "quorum",
            "DJANGO_SETTINGS_MODULE": "scheduler_project.settings.base",
            "SCHEDULER_TASK_MODULES": "tests.sample_tasks,tests.fault_tasks",
            "SAMPLE_TASK_RECORD": str(workdir / "executions.jsonl"),
            "SCHEDULER_VAR_DIR": str(workdir / "var"),
            "PYTHONUNBUFFERED": "1",
        }
        os.environ.update(env)
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        from dispatch.commands import worker_argv
        from jobs.services import job_create

        call_command("migrate", verbosity=0)
        from django.contrib.auth import get_user_model

        owner = get_user_model().objects.create_user("soak")
        processes = Processes(env, workdir)
        manage = [sys.executable, "manage.py"]
        try:
            for index in (1, 2):
                processes.start(f"scheduler{index}", [*manage, "scheduler"])
                processes.start(f"relay{index}", [*manage, "relay"])
                processes.start(
                    f"worker{index}",
                    worker_argv(name=f"worker{index}", concurrency=2, queues=["jobs"],
                                loglevel="WARNING"),
                )  # fmt: skip
            # Warm-up: the processes start and take their first runs; a window of its own,
            # so that start-up lateness is not counted as steady.
            warm_start = time.time()
            now = dt.datetime.now(dt.UTC)
            for index in range(10):
                job_create(owner=owner, spec=_spec(f"warm-up {index}", now), now=now)
            if not _settled(timeout=300):
                raise SystemExit(f"the processes did not start: see {workdir}")
            created, windows, faults_done = 10, [(warm_start, time.time())], []
            kinds = itertools.cycle(FAULTS)
            begin, begin_wall = time.monotonic(), time.time()
            end = begin + args.minutes * 60
            next_fault = begin + args.fault_every
            turn = 0
            print(f"soak: {args.minutes} min at {args.rate}/s, a fault every "
                  f"{args.fault_every} s; logs in {workdir}", flush=True)  # fmt: skip
            while time.monotonic() < end:
                tick = time.monotonic()
                now = dt.datetime.now(dt.UTC)
                due = now + dt.timedelta(seconds=2)
                for _ in range(int(args.rate)):
                    try:
                        job_create(owner=owner, spec=_spec(f"soak {created}", due), now=now)
                        created += 1
                    except Exception:  # noqa: BLE001 - not accepted: not counted
                        connection.close()
                if tick >= next_fault:
                    kind = next(kinds)
                    at = time.time()
                    # The fault runs beside the creations, as a lost machine would.
                    thread = threading.Thread(
                        target=_fault, args=(kind, processes, cluster, turn), daemon=True
                    )
                    thread.start()
                    faults_done.append((kind, at, thread))
                    turn += 1 if kind == "broker" else 0
                    next_fault += args.fault_every
                for kind, at, thread in faults_done:
                    if not thread.is_alive() and not any(w[0] == at for w in windows):
                        windows.append((at, time.time()))
                        print(f"  fault {kind} at +{at - begin_wall:.0f} s, over in "
                              f"{time.time() - at:.1f} s", flush=True)  # fmt: skip
                time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
            for _kind, at, thread in faults_done:
                thread.join(120)
                if not any(w[0] == at for w in windows):
                    windows.append((at, time.time()))
            settled = _settled(timeout=600)
            figures = _figures(windows=windows, created=created)
        finally:
            processes.stop_all()
            connection.close()
    result = {
        **results_header(args, started),
        "settled": settled,
        "faults": [(kind, round(at - begin_wall, 1)) for kind, at, _ in faults_done],
        **figures,
    }
    path = args.output or results_path(started, "-soak")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("host", "options")},
                     indent=2, default=str))  # fmt: skip
    print(f"written to {path}")
    clean = not (figures["violations"] or figures["lost"] or figures["doubled"])
    return 0 if settled and clean else 1


if __name__ == "__main__":
    sys.exit(main())
