"""The workloads of `bench.run`; each returns a dict of figures (seconds, runs/s).

Every figure comes from the product's own records (the Run rows' stage timestamps, written
with the database's clock) or, for bare Celery, from its tasks' start times; both clocks
are this machine's.
"""

from __future__ import annotations

import collections
import datetime as dt
import random
import time

from bench.bare_celery import bare_celery_burst
from bench.common import (
    RoleCpu,
    Stack,
    bench_owner,
    bench_owners,
    bench_task,
    create_due_burst,
    create_due_burst_api,
    create_once_jobs,
    once_spec,
    purge_queue,
    queue_depth,
    ratio,
    reset_database,
    summary,
    validated_spec,
    warm_up,
)

STAGES = [
    ("due_to_created", "due_at", "created_at"),
    ("created_to_published", "created_at", "published_at"),
    ("published_to_started", "published_at", "started_at"),
    ("started_to_finished", "started_at", "finished_at"),
]
FIELDS = ["id", "job_id", "state", "attempt_count", "duplicate_deliveries", "scheduled_for"]
FIELDS += ["due_at", "created_at", "published_at", "started_at", "finished_at"]


def _seconds(a: dt.datetime | None, b: dt.datetime | None) -> float | None:
    return (b - a).total_seconds() if a and b else None


def _fresh(env: dict) -> None:
    reset_database()
    purge_queue(env["CELERY_BROKER_URL"])


def _runs_of(prefix: str) -> list[dict]:
    from jobs.models import Run

    return list(Run.objects.filter(job__name__startswith=f"{prefix} ").values(*FIELDS))


def _integrity(prefix: str, runs: list[dict]) -> dict:
    """None missing, none doubled: runs per job, attempts per run, refused duplicates."""
    from jobs.models import Attempt, Job, RunState

    named = Job.objects.filter(name__startswith=f"{prefix} ")
    jobs = named.count()
    per_job = collections.Counter(run["job_id"] for run in runs)
    attempts = collections.Counter(
        Attempt.objects.filter(run__job__name__startswith=f"{prefix} ").values_list(
            "run_id", flat=True
        )
    )
    return {
        "jobs": jobs,
        "owners": named.values("owner").distinct().count(),
        "runs": len(runs),
        "succeeded": sum(run["state"] == RunState.SUCCEEDED for run in runs),
        "missing": jobs - len(per_job),
        "doubled": sum(count - 1 for count in per_job.values() if count > 1),
        "runs_with_several_attempts": sum(1 for count in attempts.values() if count > 1),
        "attempts": sum(attempts.values()),
        "duplicate_deliveries": sum(run["duplicate_deliveries"] for run in runs),
    }


def _wait_finished(stack: Stack, count: int, timeout: float) -> bool:
    """Until `count` runs in all are terminal (a cheap count on the Run table alone: the
    poll must not load the machine it measures); False on timeout."""
    from jobs.models import Run, RunState

    terminal = [RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.SKIPPED]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Run.objects.filter(state__in=terminal).count() >= count:
            return True
        stack.check_alive()
        time.sleep(0.25)
    return False


def burst_figures(prefix: str, due: dt.datetime) -> dict:
    runs = _runs_of(prefix)
    started = sorted(run["started_at"] for run in runs if run["started_at"])
    lateness = [_seconds(run["due_at"], run["started_at"]) for run in runs if run["started_at"]]
    span = _seconds(started[0], started[-1]) if len(started) > 1 else None
    return {
        "due": due.isoformat(),
        "last_start": max(lateness) if lateness else None,
        "first_start": min(lateness) if lateness else None,
        "lateness": summary(lateness),
        "throughput": (len(started) - 1) / span if span else None,
        "stages": _stages(runs),
        **_integrity(prefix, runs),
    }


def _stages(runs: list[dict]) -> dict:
    return {
        name: summary([v for run in runs if (v := _seconds(run[a], run[b])) is not None])
        for name, a, b in STAGES
    }


def bare(args, env: dict, workdir, *, tasks: int) -> dict:
    return bare_celery_burst(
        tasks=tasks,
        workers=args.workers,
        concurrency=args.concurrency,
        pool=args.pool,
        broker_url=env["CELERY_BROKER_URL"],
        workdir=workdir,
        acks_late=args.bare_acks == "late",
    )


def burst(args, env: dict, workdir, *, jobs: int, label: str, fresh: bool = True) -> dict:
    """W1: `jobs` one-time jobs due at one instant, on the whole stack; with `--owners N`,
    shared among N owners; with `--api`, created as users create them: each owner's jobs
    posted to `POST /api/v1/jobs/bulk/` of a web process (gunicorn) by a client of its own,
    all owners at once."""
    if fresh:
        _fresh(env)
    with Stack(args, env, workdir, label=label) as stack:
        stack.start()
        port = stack.start_web(args.web_workers) if args.api else None
        warmups = args.workers * args.concurrency * 2
        warm_up(stack, count=warmups)
        owners = bench_owners(args.owners)
        if args.api:
            due = create_due_burst_api(label, jobs, owners=owners, port=port,
                                       bulk_size=args.bulk_size, min_lead=args.lead)  # fmt: skip
        else:
            due = create_due_burst(label, jobs, min_lead=args.lead, owners=owners)
        cpu = RoleCpu(stack.roles(), env["DATABASE_URL"].rsplit("/", 1)[1])
        finished = _wait_finished(stack, warmups + jobs, timeout=args.timeout)
        spent = cpu.spent()
        time.sleep(1.0)  # a late duplicate delivery would be counted in this second
    figures = burst_figures(label, due)
    figures["timed_out"] = not finished
    figures["cpu_seconds"] = spent
    return figures


def w1(args, env: dict, workdir) -> dict:
    product = burst(args, env, workdir, jobs=args.jobs, label="w1")
    baseline = bare(args, env, workdir, tasks=args.jobs)
    return {
        **product,
        "bare": baseline,
        "last_start_ratio": ratio(product["last_start"], baseline["last_start"]),
        "throughput_ratio": ratio(product["throughput"], baseline["throughput"]),
    }


def bare_only(args, env: dict, workdir) -> dict:
    return bare(args, env, workdir, tasks=args.jobs)


# -- W2: steady cron ----------------------------------------------------------------------


def w2(args, env: dict, workdir) -> dict:
    """M cron jobs `* * * * *`, over K minute boundaries: lateness per boundary, and missed
    (a job without a started run at a boundary) and doubled (more than one) counts; then
    bare Celery's drain of M no-ops in the same run, each boundary's p99 beside it."""
    from jobs.models import Run, RunState
    from jobs.services import job_create

    _fresh(env)
    prefix = "w2"
    with Stack(args, env, workdir, label=prefix) as stack:
        stack.start()
        warm_up(stack, count=args.workers * args.concurrency * 2)
        owner = bench_owner()
        spec = validated_spec(
            {
                "name": prefix,
                "task": bench_task(),
                "schedule": {"kind": "cron", "expression": "* * * * *"},
            }
        )
        for index in range(args.jobs):
            now = dt.datetime.now(dt.UTC)
            job_create(owner=owner, spec={**spec, "name": f"{prefix} {index}"}, now=now)
        created = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
        first = created.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        boundaries = [first + dt.timedelta(minutes=i) for i in range(args.minutes)]
        print(f"  {args.jobs} cron jobs created; boundaries {first:%H:%M} .. "
              f"{boundaries[-1]:%H:%M}")  # fmt: skip
        last = boundaries[-1]
        while dt.datetime.now(dt.UTC) < last:
            stack.check_alive()
            time.sleep(1.0)
        deadline = time.monotonic() + args.timeout
        terminal = [RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.SKIPPED]
        while time.monotonic() < deadline:
            at_last = Run.objects.filter(scheduled_for=last, state__in=terminal)
            if at_last.count() >= args.jobs:
                break
            time.sleep(0.5)
        time.sleep(1.0)
    runs = _runs_of(prefix)
    per_boundary = []
    for boundary in boundaries:
        at = [run for run in runs if run["scheduled_for"] == boundary]
        started = [run for run in at if run["started_at"]]
        per_job = collections.Counter(run["job_id"] for run in at)
        lateness = [_seconds(run["due_at"], run["started_at"]) for run in started]
        per_boundary.append(
            {
                "boundary": boundary.isoformat(),
                "runs": len(at),
                "missed": args.jobs - len({run["job_id"] for run in started}),
                "doubled": sum(count - 1 for count in per_job.values() if count > 1),
                "skipped": sum(run["state"] == RunState.SKIPPED for run in at),
                "duplicate_deliveries": sum(run["duplicate_deliveries"] for run in at),
                "lateness": summary(lateness),
                "discovery": summary([_seconds(run["due_at"], run["created_at"]) for run in at]),
                "stages": _stages(at),
            }
        )
    p99s = [b["lateness"]["p99"] for b in per_boundary if b["lateness"]["p99"] is not None]
    # The baseline of the same run: bare Celery draining as many no-ops as a boundary has.
    baseline = bare(args, env, workdir, tasks=args.jobs)
    for b in per_boundary:
        b["p99_ratio"] = ratio(b["lateness"]["p99"], baseline["last_start"])
    return {
        "jobs": args.jobs,
        "boundaries": per_boundary,
        "worst_p99": max(p99s) if p99s else None,
        "bare": baseline,
        "worst_p99_ratio": ratio(max(p99s) if p99s else None, baseline["last_start"]),
        "missed": sum(b["missed"] for b in per_boundary),
        "doubled": sum(b["doubled"] for b in per_boundary),
        "duplicate_deliveries": sum(b["duplicate_deliveries"] for b in per_boundary),
    }


# -- W3: idle scaling ---------------------------------------------------------------------


def insert_future_jobs(count: int, *, days: float = 30.0) -> float:
    """`count` one-time jobs due in the next `days` (from an hour ahead), in three bulk
    INSERT ... SELECT statements writing what `jobs.services.job_create` writes: the job
    (active, version 1, spec, next_run_at), its first JobVersion and its `job.created`
    audit event. Then VACUUM ANALYZE, as autovacuum would soon (200,000 inserts start its
    insert-triggered vacuum of three tables, which otherwise ran during the burst measured
    next): the jobs stand as jobs that have been there a while. Returns the seconds it
    took."""
    import json

    from django.db import connection, transaction

    from jobs.audit import actor_label
    from jobs.models import AuditEvent, Job, JobVersion

    owner = bench_owner()
    template = validated_spec(
        {
            "name": "future",
            "task": "tests.record",
            "schedule": {"kind": "once", "run_at": "2035-01-01T00:00:00+00:00"},
        }
    )
    job, version, audit = Job._meta.db_table, JobVersion._meta.db_table, AuditEvent._meta.db_table
    began = time.monotonic()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {job} (id, owner_id, name, task, state, version, spec, queue, priority,
                               labels, next_run_at, created_at, updated_at)
            SELECT gen_random_uuid(), %(owner)s, 'future ' || g, %(task)s, 'active', 1,
                   jsonb_set(jsonb_set(%(spec)s::jsonb, '{{name}}', to_jsonb('future ' || g)),
                             '{{schedule,run_at}}',
                             to_jsonb(to_char(due AT TIME ZONE 'UTC',
                                              'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))),
                   %(queue)s, %(priority)s, %(labels)s::jsonb, due, now(), now()
            FROM generate_series(1, %(count)s) AS g,
                 LATERAL (SELECT date_trunc('milliseconds', now() + interval '1 hour'
                          + random() * %(days)s * interval '1 day') + g * interval '0 seconds'
                          AS due) AS d
            """,
            {
                "owner": owner.pk,
                "task": template["task"],
                "spec": json.dumps(template),
                "queue": template["queue"],
                "priority": template["priority"],
                "labels": json.dumps(template["labels"]),
                "count": count,
                "days": days,
            },
        )
        cursor.execute(
            f"""
            INSERT INTO {version} (job_id, version, spec, created_at, created_by_id)
            SELECT id, 1, spec, created_at, owner_id FROM {job} WHERE name LIKE 'future %%'
            """
        )
        cursor.execute(
            f"""
            INSERT INTO {audit} (created_at, actor_id, actor_label, action, job_id, data)
            SELECT created_at, owner_id, %s, 'job.created', id, '{{"version": 1}}'::jsonb
            FROM {job} WHERE name LIKE 'future %%'
            """,
            [actor_label(owner)],
        )
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM (ANALYZE) {job}, {version}, {audit}")
    return time.monotonic() - began


def w3(args, env: dict, workdir) -> dict:
    """W1 with `--jobs` behind `--future` future jobs, against W1 without them, same run."""
    without = burst(args, env, workdir, jobs=args.jobs, label="w3a")
    _fresh(env)
    inserted_in = insert_future_jobs(args.future)
    print(f"  {args.future} future jobs inserted in {inserted_in:.1f}s")
    behind = burst(args, env, workdir, jobs=args.jobs, label="w3b", fresh=False)
    return {
        "future_jobs": args.future,
        "insert_seconds": inserted_in,
        "without": without,
        "behind": behind,
        "last_start_ratio": ratio(behind["last_start"], without["last_start"]),
    }


# -- claim-to-broker ----------------------------------------------------------------------


def claim(args, env: dict, workdir) -> dict:
    """Schedulers and relays only: from the due instant until every run is created and no
    outbox row is left pending (the relay has its confirms), whether the relay marks
    confirmed rows published or deletes them."""
    from jobs.models import OutboxMessage, OutboxState, Run

    _fresh(env)
    prefix = "claim"
    with Stack(args, env, workdir, label=prefix) as stack:
        stack.start(workers=False)
        create_once_jobs("warmup", 1, dt.datetime.now(dt.UTC))
        deadline = time.monotonic() + 120
        while not (
            Run.objects.count() == 1
            and not OutboxMessage.objects.filter(state=OutboxState.PENDING).exists()
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"warm-up run not published: see {workdir}")
            time.sleep(0.1)
        due = create_due_burst(prefix, args.jobs, min_lead=args.lead)
        done_at = None
        deadline = time.monotonic() + args.timeout + (due - dt.datetime.now(dt.UTC)).total_seconds()
        while time.monotonic() < deadline:
            # Cheap statements only (no join): the poll must not load what it measures.
            runs = Run.objects.count() - 1  # less the warm-up's
            pending = OutboxMessage.objects.filter(state=OutboxState.PENDING).exists()
            if runs >= args.jobs and not pending:
                done_at = dt.datetime.now(dt.UTC)
                break
            stack.check_alive()
            time.sleep(0.05)
        depth = queue_depth(env["CELERY_BROKER_URL"])
    runs = _runs_of(prefix)
    created = sorted(run["created_at"] for run in runs)
    seconds = _seconds(due, done_at)
    return {
        "jobs": args.jobs,
        "runs": len(runs),
        "doubled": len(runs) - len({run["job_id"] for run in runs}),
        "in_broker": depth - 1 if depth is not None else None,  # less the warm-up's message
        "seconds": seconds,
        "runs_per_second": args.jobs / seconds if seconds else None,
        "first_created": _seconds(due, created[0]) if created else None,
        "last_created": _seconds(due, created[-1]) if created else None,
        "discovery": summary([_seconds(run["due_at"], run["created_at"]) for run in runs]),
        "timed_out": done_at is None,
    }


# -- precision ----------------------------------------------------------------------------


def precision(args, env: dict, workdir) -> dict:
    """One one-time job at a time on an idle system, due `--precision-lead` seconds after its
    creation: started_at - due_at over `--trials` trials."""
    from jobs.models import Run, RunState
    from jobs.services import job_create

    _fresh(env)
    prefix = "precision"
    owner = bench_owner()
    rng = random.Random(10)
    with Stack(args, env, workdir, label=prefix) as stack:
        stack.start()
        warm_up(stack, count=args.workers * args.concurrency * 2)
        for trial in range(args.trials):
            now = dt.datetime.now(dt.UTC)
            due = now + dt.timedelta(seconds=args.precision_lead)
            job = job_create(owner=owner, spec=once_spec(f"{prefix} {trial}", due), now=now)
            deadline = time.monotonic() + 60
            while not Run.objects.filter(job=job, state=RunState.SUCCEEDED).exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"precision trial {trial} did not finish: see {workdir}")
                time.sleep(0.02)
            time.sleep(rng.uniform(0.05, 0.3))  # idle again, at a random phase
    runs = _runs_of(prefix)
    lateness = [_seconds(run["due_at"], run["started_at"]) for run in runs if run["started_at"]]
    return {
        "trials": args.trials,
        "lead": args.precision_lead,
        "lateness": summary(lateness),
        "stages": _stages(runs),
        **_integrity(prefix, runs),
    }


WORKLOADS = {
    "w1": w1,
    "w2": w2,
    "w3": w3,
    "claim": claim,
    "precision": precision,
    "bare": bare_only,
}
