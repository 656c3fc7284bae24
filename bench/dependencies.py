"""Dependencies between jobs: what an upstream run's end costs, and how soon its dependent
starts.

    .venv/bin/python -m bench.dependencies [--samples 200] [--history 200000] [--chains 100]

1. Cost (in-process, no workers): B runs after A. Each sample ends one run of A
   (`attempt_succeed`, its trigger writing the signal, committed) and then runs the
   scheduler's dependencies step (`dependencies_run_once`), which creates B's run with its
   outbox row: the figure is the time from before A's end to after B's creation, p50/p99,
   with no history, then with `--history` finished runs of A (and as many of B, and
   decided gates) in the tables. The modes alternate per block, so the machine's noise
   falls on both. EXPLAIN (ANALYZE, BUFFERS) of each statement on the path is printed
   with the history in place.
2. Latency (real scheduler, relay and worker, idle): `--chains` one-time jobs A due 0.3 s
   apart, each with a B after it: B's `created_at` and `started_at` minus A's
   `finished_at`, p50/p99.

Creates a fresh database and vhost (dropped afterwards).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time

from bench.common import Stack, bench_environment, summary, validated_spec

BLOCK = 20  # samples per mode before switching


def _head_and_dependent(owner, now, name):
    from jobs.services import job_create

    a = job_create(
        owner=owner,
        spec=validated_spec({"name": f"{name} A", "task": "tests.record",
                             "schedule": {"kind": "cron", "expression": "* * * * *"}}),
        now=now,
    )  # fmt: skip
    b = job_create(
        owner=owner,
        spec=validated_spec({"name": f"{name} B", "task": "tests.record",
                             "schedule": {"kind": "after", "jobs": [str(a.id)]}}),
        now=now,
    )  # fmt: skip
    return a, b


def _history(a, b, count: int) -> None:
    """`count` finished runs of A and of B, and B's decided gates, at instants before 2020."""
    from django.db import connection

    with connection.cursor() as cursor:
        for job in (a, b):
            cursor.execute(
                """
                INSERT INTO jobs_run (id, job_id, job_version_id, kind, state, scheduled_for,
                    idempotency_key, fencing_token, attempt_count, failure_reason, skip_reason,
                    due_at, created_at, started_at, finished_at, updated_at,
                    duplicate_deliveries, retry_base, republish_count)
                SELECT gen_random_uuid(), %s, v.id, 'scheduled', 'succeeded', t,
                       %s || ':' || g, 1, 1, '', '', t, t, t, t, t, 0, 0, 0
                  FROM generate_series(1, %s) AS g,
                       LATERAL (SELECT timestamptz '2000-01-01' + g * interval '1 minute') AS s(t),
                       jobs_jobversion v
                 WHERE v.job_id = %s
                """,
                [job.id, f"{job.id}:history", count, job.id],
            )
        cursor.execute(
            """
            INSERT INTO jobs_dependency_gate (job_id, scheduled_for, kind, state, missing,
                arrived_jobs, arrived_runs, created_at)
            SELECT %s, timestamptz '2000-01-01' + g * interval '1 minute', 'scheduled',
                   'decided', 0, ARRAY[%s::uuid], ARRAY[gen_random_uuid()], now()
              FROM generate_series(1, %s) AS g
            """,
            [b.id, a.id, count],
        )
        # Their inserts signalled B (a run inserted terminal is an end): long consumed, in
        # the history this stands for.
        cursor.execute("DELETE FROM jobs_dependency_signal")
        # As autovacuum would have since: 200,000 dead entries left in the signals' index
        # cost its claim 46 ms (3,222 buffers) until vacuumed.
        cursor.execute("VACUUM ANALYZE")


def _one_sample(a, at: dt.datetime) -> float:
    """Seconds from before A's run at `at` ends to after B's run for it exists."""
    from django.db import transaction

    from dispatch.dependencies import DependenciesConfig, dependencies_run_once
    from jobs.models import Run
    from jobs.transitions import attempt_succeed, run_claim
    from storage.schedule import runs_write_scheduled  # noqa: F401 - the materializer's path

    run = Run.objects.create(
        job=a, job_version=a.versions.get(), state="queued", scheduled_for=at, due_at=at,
        created_at=at, idempotency_key=f"{a.id}:bench:{at.isoformat()}",
    )  # fmt: skip
    attempt = run_claim(run_id=run.id, worker="bench", now=at, lease_seconds=60)
    began = time.perf_counter()
    with transaction.atomic():
        attempt_succeed(attempt=attempt, now=at)
    result = dependencies_run_once(now=at, config=DependenciesConfig())
    took = time.perf_counter() - began
    assert result.runs_created == 1, result
    return took


def _explain(a, b) -> str:
    from django.db import connection, transaction

    from jobs.models import DependencyGate, DependencySignal, JobDependency, Run
    from jobs.transitions import attempt_succeed, run_claim

    at = dt.datetime(2031, 1, 1, tzinfo=dt.UTC)
    with transaction.atomic():
        claim_plan = (
            DependencySignal.objects.select_for_update(skip_locked=True)
            .filter(created_at__lte=at)
            .order_by("id")[:500]
            .explain(analyze=True, buffers=True)
        )
    plans = [
        ("the trigger's probe: does the job have dependents",
         JobDependency.objects.filter(upstream_id=a.id).explain(analyze=True, buffers=True)),
        ("the signals' claim (FOR UPDATE SKIP LOCKED)", claim_plan),
        ("the edges of the signalled jobs",
         JobDependency.objects.filter(upstream_id__in=[a.id]).explain(analyze=True, buffers=True)),
        ("the gate of (B, instant, kind)",
         DependencyGate.objects.filter(job=b, scheduled_for=at, kind="scheduled")
         .explain(analyze=True, buffers=True)),
        ("B's run for the instant (idempotency key)",
         Run.objects.filter(idempotency_key=f"{b.id}:x").explain(analyze=True, buffers=True)),
        ("the deadline loop's claim",
         DependencyGate.objects.filter(state="waiting", deadline_at__isnull=False,
                                       deadline_at__lte=at).order_by("deadline_at")[:500]
         .explain(analyze=True, buffers=True)),
    ]  # fmt: skip
    run = Run.objects.create(
        job=a, job_version=a.versions.get(), state="queued", scheduled_for=at, due_at=at,
        created_at=at, idempotency_key=f"{a.id}:explain",
    )  # fmt: skip
    attempt = run_claim(run_id=run.id, worker="bench", now=at, lease_seconds=60)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS) UPDATE jobs_run SET state = 'succeeded', "
            "finished_at = %s WHERE id = %s",
            [at, run.id],
        )
        plans.append(("A's terminal UPDATE, with its triggers",
                      "\n".join(row[0] for row in cursor.fetchall())))  # fmt: skip
        transaction.set_rollback(True)
    del attempt, attempt_succeed
    return "\n\n".join(f"-- {title}\n{plan}" for title, plan in plans)


def cost(args) -> dict:
    from jobs.models import DependencySignal, Job, Run

    owner_model = __import__("django.contrib.auth", fromlist=["get_user_model"]).get_user_model()
    owner = owner_model.objects.get_or_create(username="bench")[0]
    now = dt.datetime.now(dt.UTC)
    empty = _head_and_dependent(owner, now, "empty")
    full = _head_and_dependent(owner, now, "history")
    began = time.monotonic()
    _history(*full, args.history)
    print(f"history: {args.history} runs of A and of B, {args.history} gates "
          f"({time.monotonic() - began:.0f}s)")  # fmt: skip
    figures: dict[str, list[float]] = {"none": [], "history": []}
    start = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    for block in range(0, args.samples, BLOCK):
        for mode, (a, _b) in (("none", empty), ("history", full)):
            for index in range(block, min(block + BLOCK, args.samples)):
                figures[mode].append(_one_sample(a, start + dt.timedelta(minutes=index)))
    assert not DependencySignal.objects.exists()
    assert Run.objects.filter(job=empty[1]).count() == args.samples
    plans = _explain(*full)
    del Job
    return {"summaries": {mode: summary(values) for mode, values in figures.items()},
            "plans": plans}  # fmt: skip


def latency(args, env, workdir) -> dict:
    from jobs.models import Run
    from jobs.services import job_create

    stack_args = argparse.Namespace(schedulers=1, relays=1, workers=1, concurrency=2,
                                    pool="prefork", scheduler_args="", relay_args="",
                                    worker_args="")  # fmt: skip
    owner = (
        __import__("django.contrib.auth", fromlist=["x"])
        .get_user_model()
        .objects.get(username="bench")
    )
    with Stack(stack_args, env, workdir, label="latency").start():
        time.sleep(5)  # the worker boots
        now = dt.datetime.now(dt.UTC)
        first = now + dt.timedelta(seconds=5)
        pairs = []
        for index in range(args.chains):
            due = first + dt.timedelta(seconds=0.3 * index)
            a = job_create(owner=owner, now=now, spec=validated_spec(
                {"name": f"chain {index} A", "task": "tests.record",
                 "schedule": {"kind": "once", "run_at": due.isoformat()}}))  # fmt: skip
            b = job_create(owner=owner, now=now, spec=validated_spec(
                {"name": f"chain {index} B", "task": "tests.record",
                 "schedule": {"kind": "after", "jobs": [str(a.id)]}}))  # fmt: skip
            pairs.append((a, b))
        deadline = time.monotonic() + 60 + 0.3 * args.chains
        b_ids = [b.id for _, b in pairs]
        while Run.objects.filter(job_id__in=b_ids, started_at__isnull=False).count() < len(pairs):
            if time.monotonic() > deadline:
                raise SystemExit(f"B runs did not all start: see {workdir}")
            time.sleep(0.5)
    created, started = [], []
    for a, b in pairs:
        a_run, b_run = Run.objects.get(job=a), Run.objects.get(job=b)
        created.append((b_run.created_at - a_run.finished_at).total_seconds())
        started.append((b_run.started_at - a_run.finished_at).total_seconds())
    return {"created": summary(created), "started": summary(started)}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.dependencies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--history", type=int, default=200_000)
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()
    with bench_environment("bench_dependencies", task_modules="tests.sample_tasks") as (
        env,
        workdir,
    ):
        import os

        print(f"load average before: {os.getloadavg()}")
        costs = cost(args)
        print(json.dumps(costs["summaries"], indent=2))
        print(costs["plans"])
        if not args.skip_latency:
            print("latency on an idle system (seconds from A's end):")
            print(json.dumps(latency(args, env, workdir), indent=2))
        print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
