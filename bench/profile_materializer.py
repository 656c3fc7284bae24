"""The scheduler path alone: how fast due occurrences become runs (no relay, no workers).

    .venv/bin/python -m bench.profile_materializer pass --jobs 10000 [--profile 25]
    .venv/bin/python -m bench.profile_materializer replicas --jobs 10000 --schedulers 2
    .venv/bin/python -m bench.profile_materializer precision --trials 50

- `pass`: N one-time jobs due now, materialized in this process by `scheduler_run_once`
  passes until none is due; prints runs/s, and with --profile the top cProfile entries.
- `replicas`: N one-time jobs due at one instant, `manage.py scheduler` replicas in
  processes of their own; prints the discovery lag (run.created_at - run.due_at) and when
  the last run was committed.
- `precision`: one scheduler replica on an idle database; one one-time job at a time, due
  a few hundred ms after it is created; prints the discovery lag over the trials.

Each mode makes a fresh PostgreSQL database (bench.common), dropped afterwards. The
jobs are written in bulk, as `jobs.services.job_create` writes them (job, first version),
so creating 10,000 takes seconds, not minutes; `precision` creates its jobs through
`job_create` itself, whose NOTIFY is part of what it measures.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, bench_environment


def quantiles(values: list[float]) -> str:
    values = sorted(values)
    if not values:
        return "n/a"
    p = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    ms = lambda seconds: f"{seconds * 1000:8.1f} ms"  # noqa: E731
    return f"p50 {ms(p(0.5))}  p99 {ms(p(0.99))}  max {ms(values[-1])}"


def one_time_spec(run_at: dt.datetime, **overrides) -> dict:
    from jobs.api.validation import JobSpecSerializer

    serializer = JobSpecSerializer(
        data={
            "name": "bench",
            "task": "tests.record",
            "schedule": {"kind": "once", "run_at": run_at.isoformat()},
            **overrides,
        }
    )
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def create_jobs_in_bulk(owner, *, count: int, run_at: dt.datetime, now: dt.datetime) -> None:
    """What job_create writes for `count` jobs (the job and its first version), in bulk."""
    from django.db import transaction

    from jobs.models import Job, JobVersion
    from jobs.schedules import job_first_fire

    spec = one_time_spec(run_at)
    first = job_first_fire(spec=spec, now=now)
    with transaction.atomic():
        for start in range(0, count, 2000):
            jobs = Job.objects.bulk_create(
                Job(owner=owner, name=f"bench {i}", task=spec["task"],
                    spec={**spec, "name": f"bench {i}"}, queue=spec["queue"],
                    priority=spec["priority"], labels=spec["labels"], next_run_at=first,
                    created_at=now)
                for i in range(start, min(count, start + 2000))
            )  # fmt: skip
            JobVersion.objects.bulk_create(
                JobVersion(job=job, version=1, spec=job.spec, created_by=owner) for job in jobs
            )


def mode_pass(args) -> None:
    from django.contrib.auth import get_user_model

    from dispatch.scheduler import SchedulerConfig, scheduler_run_once
    from jobs.clock import db_now
    from jobs.models import Run

    owner = get_user_model().objects.create_user("bench")
    now = db_now()
    create_jobs_in_bulk(owner, count=args.jobs, run_at=now, now=now - dt.timedelta(seconds=1))
    config = SchedulerConfig(batch_size=args.batch_size) if args.batch_size else SchedulerConfig()
    profile = cProfile.Profile()
    passes = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    if args.profile:  # the profiler's own cost shows in the runs/s: compare runs without it
        profile.enable()
    while True:
        result = scheduler_run_once(now=db_now(), config=config)
        passes += 1
        if not result.batch_full:
            break
    profile.disable()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    created = Run.objects.count()
    # The box is shared: this process's own CPU time is the steadier figure.
    print(
        f"{created} runs in {passes} passes (batch {config.batch_size}), {elapsed:.2f} s: "
        f"{created / elapsed:,.0f} runs/s; this process's CPU {cpu:.2f} s"
    )
    if args.profile:
        order = os.environ.get("PROFILE_SORT", "cumulative")  # or tottime
        pstats.Stats(profile).sort_stats(order).print_stats(args.profile)


def start_schedulers(env: dict, workdir: Path, count: int, extra: list[str]) -> list:
    """`count` scheduler replicas, returned once each has started its loops."""
    path = workdir / "schedulers.log"
    log = open(path, "ab")  # noqa: SIM115
    command = [sys.executable, str(ROOT / "manage.py"), "scheduler", "--without-reaper",
               "--without-reconciler", "--without-pruner", *extra]  # fmt: skip
    processes = [
        subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        for _ in range(count)
    ]
    deadline = time.monotonic() + 60
    while path.read_text().count("scheduler started") < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the schedulers did not start: {path.read_text()[-2000:]}")
        time.sleep(0.1)
    return processes


def stop(processes: list) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def mode_replicas(args, env: dict, workdir: Path) -> None:
    from django.contrib.auth import get_user_model

    from jobs.clock import db_now
    from jobs.models import Run

    owner = get_user_model().objects.create_user("bench")
    extra = ["--batch-size", str(args.batch_size)] if args.batch_size else []
    schedulers = start_schedulers(env, workdir, args.schedulers, extra)
    try:
        now = db_now()
        due = now + dt.timedelta(seconds=args.lead)
        create_jobs_in_bulk(owner, count=args.jobs, run_at=due, now=now)
        if db_now() > due - dt.timedelta(seconds=1):
            print("warning: creating the jobs took nearly the whole lead; raise --lead")
        last_commit = None
        deadline = time.monotonic() + args.lead + 120
        while time.monotonic() < deadline:
            if Run.objects.count() >= args.jobs:
                last_commit = db_now()
                break
            time.sleep(0.05)
        lags = [
            (created - due_at).total_seconds()
            for created, due_at in Run.objects.values_list("created_at", "due_at")
        ]
        print(f"{len(lags)} runs of {args.jobs} jobs, {args.schedulers} scheduler replicas")
        print(f"discovery lag (created_at - due_at): {quantiles(lags)}; first {min(lags):.3f} s")
        if last_commit is not None:
            seen = (last_commit - due).total_seconds()
            print(f"the last run was committed (seen) {seen:.3f} s after due")
        doubled = len(lags) - Run.objects.values("job_id").distinct().count()
        print(f"doubled runs: {doubled}")
    finally:
        stop(schedulers)


def mode_precision(args, env: dict, workdir: Path) -> None:
    from django.contrib.auth import get_user_model

    from jobs.clock import db_now
    from jobs.models import Run
    from jobs.services import job_create

    owner = get_user_model().objects.create_user("bench")
    schedulers = start_schedulers(env, workdir, 1, [])
    try:
        time.sleep(1)  # idle
        lags = []
        for _ in range(args.trials):
            now = db_now()
            job = job_create(
                owner=owner, spec=one_time_spec(now + dt.timedelta(seconds=args.due_in)), now=now
            )
            deadline = time.monotonic() + args.due_in + 5
            while time.monotonic() < deadline:
                run = Run.objects.filter(job=job).values_list("created_at", "due_at").first()
                if run is not None:
                    lags.append((run[0] - run[1]).total_seconds())
                    break
                time.sleep(0.01)
            time.sleep(0.2)  # idle again
        print(f"{len(lags)} of {args.trials} one-time jobs due {args.due_in:.2f} s after creation")
        print(f"discovery lag (created_at - due_at): {quantiles(lags)}")
    finally:
        stop(schedulers)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_materializer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", choices=("pass", "replicas", "precision"))
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the product's")
    parser.add_argument("--profile", type=int, default=0, help="print this many profile rows")
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--lead", type=float, default=8.0, help="seconds until the jobs are due")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--due-in", type=float, default=0.3)
    args = parser.parse_args()
    with bench_environment("benchmat", task_modules="tests.sample_tasks") as (env, workdir):
        if args.mode == "pass":
            mode_pass(args)
        elif args.mode == "replicas":
            mode_replicas(args, env, workdir)
        else:
            mode_precision(args, env, workdir)


if __name__ == "__main__":
    main()
