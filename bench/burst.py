"""Burst benchmark: N one-time jobs due at the same second, on the real stack.

    .venv/bin/python bench/burst.py --jobs 2000 --schedulers 2 --relays 2 --workers 2

Creates a fresh PostgreSQL database and RabbitMQ vhost (dropped afterwards), starts real
scheduler, relay and Celery worker processes, and prints the lateness of every stage
(p50 / p99 / max, seconds): due -> created -> published -> started -> finished. Then, on the
same broker and with the same workers, bare Celery drains as many no-op tasks published at
once (bench/bare_celery.py), and the ratio of the two is printed: the figure to quote, since
the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bare_celery import bare_celery_burst  # noqa: E402
from common import ROOT, bench_environment  # noqa: E402


def quantiles(values: list[float]) -> str:
    values = sorted(values)
    if not values:
        return "n/a"
    p = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return f"p50 {p(0.5):6.2f}  p99 {p(0.99):6.2f}  max {values[-1]:6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--relays", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool", default="prefork", help="the Celery pool: prefork, solo, threads")
    parser.add_argument("--worker-args", default="", help='more worker options, e.g. "-O fair"')
    parser.add_argument("--lead", type=float, default=15.0, help="seconds until the jobs are due")
    args = parser.parse_args()

    with bench_environment("bench", task_modules="tests.sample_tasks") as (env, workdir):
        run_burst(args, env, workdir)


def run_burst(args, env: dict, workdir: Path) -> None:
    from django.contrib.auth import get_user_model

    from dispatch.commands import worker_argv
    from jobs.models import Run, RunState
    from jobs.services import job_create
    from jobs.validation import JobSpecSerializer

    processes = []
    try:
        owner = get_user_model().objects.create_user("bench")
        now = dt.datetime.now(dt.UTC)
        due = (now + dt.timedelta(seconds=args.lead)).replace(microsecond=0)
        spec = JobSpecSerializer(
            data={
                "name": "bench",
                "task": "tests.record",
                "schedule": {"kind": "once", "run_at": due.isoformat()},
            }
        )
        spec.is_valid(raise_exception=True)
        for index in range(args.jobs):
            job_create(owner=owner, spec={**spec.validated_data, "name": f"bench {index}"}, now=now)
        created_in = (dt.datetime.now(dt.UTC) - now).total_seconds()
        if created_in > args.lead - 5:
            print(f"warning: creating the jobs took {created_in:.1f}s; raise --lead")
        manage = [sys.executable, str(ROOT / "manage.py")]
        log = open(workdir / "processes.log", "ab")  # noqa: SIM115
        for _ in range(args.schedulers):
            processes.append(
                subprocess.Popen(
                    [*manage, "scheduler", "--poll-interval", "0.5"],
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
        for _ in range(args.relays):
            processes.append(subprocess.Popen([*manage, "relay"], env=env, stdout=log, stderr=log))
        for index in range(args.workers):
            argv = worker_argv(
                name=f"w{index}",
                concurrency=args.concurrency,
                queues=["jobs"],
                loglevel="WARNING",
                extra=(f"--pool={args.pool}", *shlex.split(args.worker_args)),
            )
            processes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log, cwd=ROOT))
        deadline = time.monotonic() + args.lead + 600
        while time.monotonic() < deadline:
            done = Run.objects.filter(state=RunState.SUCCEEDED).count()
            if done == args.jobs:
                break
            time.sleep(0.5)
        runs = list(Run.objects.all())
        print(
            f"{args.jobs} one-time jobs due at {due:%H:%M:%S}; {args.schedulers} schedulers, "
            f"{args.relays} relays, {args.workers} workers x {args.concurrency}"
        )
        print(f"runs: {len(runs)}, succeeded: {sum(r.state == RunState.SUCCEEDED for r in runs)}")
        stages = [
            ("due -> created", "due_at", "created_at"),
            ("created -> published", "created_at", "published_at"),
            ("published -> started", "published_at", "started_at"),
            ("started -> finished", "started_at", "finished_at"),
            ("due -> started (lateness)", "due_at", "started_at"),
        ]
        for label, start, end in stages:
            values = [
                (getattr(r, end) - getattr(r, start)).total_seconds()
                for r in runs
                if getattr(r, end) and getattr(r, start)
            ]
            print(f"  {label:28s} {quantiles(values)}")
        started = sorted(r.started_at for r in runs if r.started_at)
        span = (started[-1] - started[0]).total_seconds() if started else 0.0
        throughput = len(started) / max(span, 1e-9)
        print(f"  throughput: {throughput:.0f} runs/s started")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
    last_start = max((r.started_at - r.due_at).total_seconds() for r in runs if r.started_at)
    bare = bare_celery_burst(
        tasks=args.jobs,
        workers=args.workers,
        concurrency=args.concurrency,
        pool=args.pool,
        broker_url=env["CELERY_BROKER_URL"],
        workdir=workdir,
    )
    print(
        f"bare Celery, same broker and workers: last start {bare['last_start']:.2f}s, "
        f"{bare['throughput']:.0f} tasks/s started"
    )
    print(
        f"ratio to bare Celery: last start x{last_start / bare['last_start']:.2f}, "
        f"throughput x{throughput / bare['throughput']:.2f}"
    )


if __name__ == "__main__":
    main()
