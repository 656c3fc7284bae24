"""Log capture overhead: a handler printing N lines, with capture on and with it off.

    .venv/bin/python -m bench.logs --lines 10000 --runs 5

Creates a fresh PostgreSQL database and RabbitMQ vhost (dropped afterwards), starts a real
scheduler, relay and one Celery worker (concurrency 1), and runs the same job `--runs`
times with the worker capturing logs, then again with a worker started with
SCHEDULER_LOG_CAPTURE=false (output then goes to the worker's own log, as with plain
Celery). Prints the run durations (started -> finished, seconds) and the overhead.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, bench_environment


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.logs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    modules = "tests.sample_tasks,tests.fault_tasks"
    with bench_environment("bench_logs", task_modules=modules) as (env, workdir):
        run_logs_bench(args, env, workdir)


def run_logs_bench(args, env: dict, workdir: Path) -> None:
    from django.contrib.auth import get_user_model

    from dispatch.commands import worker_argv
    from jobs.api.validation import JobSpecSerializer
    from jobs.models import Run, RunState
    from jobs.services import job_create
    from logs_app.models import LogManifest

    processes: list[subprocess.Popen] = []

    def start(argv: list[str], log: str, **extra: str) -> subprocess.Popen:
        process = subprocess.Popen(
            argv, cwd=ROOT, env={**env, **extra},
            stdout=open(workdir / log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )  # fmt: skip
        processes.append(process)
        return process

    def wait_ready(log: str) -> None:
        deadline = time.monotonic() + 60
        while b" ready." not in (workdir / log).read_bytes():
            if time.monotonic() > deadline:
                raise SystemExit(f"worker not ready: see {workdir / log}")
            time.sleep(0.2)

    def measure(label: str) -> list[float]:
        owner = get_user_model().objects.get_or_create(username="bench")[0]
        durations = []
        for _ in range(args.runs):
            now = dt.datetime.now(dt.UTC)
            spec = JobSpecSerializer(data={
                "name": "chatty", "task": "faults.chatty", "args": [args.lines],
                "schedule": {"kind": "once", "run_at": now.isoformat()},
            })  # fmt: skip
            spec.is_valid(raise_exception=True)
            job = job_create(owner=owner, spec=dict(spec.validated_data), now=now)
            deadline = time.monotonic() + 120
            while not Run.objects.filter(job=job, state=RunState.SUCCEEDED).exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"{label}: run did not succeed; see {workdir}")
                time.sleep(0.1)
            run = Run.objects.get(job=job)
            durations.append((run.finished_at - run.started_at).total_seconds())
            if label == "capture on":
                manifest = LogManifest.objects.get(attempt__run=run)
                assert manifest.line_count == args.lines, manifest.line_count
        return durations

    try:
        start([sys.executable, "manage.py", "scheduler", "--poll-interval", "0.2"], "scheduler.log")
        start([sys.executable, "manage.py", "relay"], "relay.log")
        results = {}
        for label, capture in (("capture on", "true"), ("capture off", "false")):
            log = f"worker-{capture}.log"
            worker = start(
                worker_argv(name=f"w{capture}", concurrency=1, queues=["jobs"]),
                log,
                SCHEDULER_LOG_CAPTURE=capture,
            )
            wait_ready(log)
            measure(label)  # warm-up run, not counted
            results[label] = measure(label)
            worker.terminate()
            worker.wait(timeout=60)
        on = statistics.median(results["capture on"])
        off = statistics.median(results["capture off"])
        for label, values in results.items():
            print(f"{label:12s} runs {', '.join(f'{v:.3f}' for v in values)}  "
                  f"median {statistics.median(values):.3f}s")  # fmt: skip
        print(f"{args.lines} lines per run: capture overhead {100 * (on - off) / off:+.1f}% "
              f"of the run's duration (median {on:.3f}s vs {off:.3f}s)")  # fmt: skip
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
