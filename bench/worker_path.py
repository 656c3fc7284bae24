"""The worker's database path in process: claim, run a no-op handler, complete.

    .venv/bin/python -m bench.worker_path --runs 2000 [--profile] [--pack 20] [--history 50]

No broker and no Celery: it measures what one delivery costs our code and PostgreSQL
(statements per run, runs per second in one process, the run and attempt tables' updates a
run, their HOT share and the index blocks they touch, and with --profile the functions
that take the time), the part of a run that bare Celery does not have. `--pack N`
delivers the runs N to a message, as the relay packs a task declared `pack=N`.
`--history K` gives each job K finished runs (succeeded, with their attempts) before the
measured ones, so that the claims and successes write into indexes of a table that has a
history (K=50: 100,000 runs beside 2,000).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import pstats
import time

from bench.common import bench_environment


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.worker_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--pack", type=int, default=1, help="runs per delivered message")
    parser.add_argument("--history", type=int, default=0, help="finished runs per job before")
    args = parser.parse_args()
    with bench_environment("wpath", task_modules="tests.sample_tasks"):
        measure(args)


def measure(args) -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from dispatch.scheduler import SchedulerConfig, scheduler_run_once
    from dispatch.worker import run_execute_deliveries, run_execute_delivery
    from jobs.api.validation import JobSpecSerializer
    from jobs.clock import db_now
    from jobs.models import Run, RunState
    from jobs.services import job_create

    owner = get_user_model().objects.create_user("bench")
    now = db_now()
    spec = JobSpecSerializer(
        data={"name": "w", "task": "tests.record",
              "schedule": {"kind": "once", "run_at": now.isoformat()}}
    )  # fmt: skip
    spec.is_valid(raise_exception=True)
    for index in range(args.runs):
        job_create(owner=owner, spec={**spec.validated_data, "name": f"w {index}"}, now=now)
    insert_history(args.history)
    while scheduler_run_once(now=db_now(), config=SchedulerConfig(batch_size=1000)).batch_full:
        pass
    run_ids = [
        str(i) for i in Run.objects.filter(state=RunState.QUEUED).values_list("id", flat=True)
    ]
    published = dt.datetime.now(dt.UTC).isoformat()

    def noop(ctx, *args, **kwargs):
        return None

    def deliver_all(ids):
        if args.pack > 1:
            for start in range(0, len(ids), args.pack):
                run_execute_deliveries(
                    run_ids=ids[start : start + args.pack], handler=noop, worker="bench",
                    message_id=ids[start], published_at=published,
                )  # fmt: skip
            return
        for run_id in ids:
            run_execute_delivery(
                run_id=run_id, handler=noop, worker="bench", message_id=run_id,
                published_at=published,
            )  # fmt: skip

    warm, rest = run_ids[:50], run_ids[50:]
    deliver_all(warm)
    with CaptureQueriesContext(connection) as queries:
        deliver_all(rest[:100])
    profiler = cProfile.Profile() if args.profile else None
    before = table_figures()
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    deliver_all(rest[100:])
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - started
    measured = len(rest) - 100
    after = table_figures()
    done = Run.objects.filter(id__in=run_ids, state=RunState.SUCCEEDED).count()
    print(f"runs: {len(run_ids)}, succeeded: {done}")
    print(f"statements per run: {len(queries) / 100:.1f}")
    print(f"one process: {measured / elapsed:.0f} runs/s ({elapsed / measured * 1e3:.2f} ms/run)")
    for table in TABLES:
        updates, hot, blocks = (b - a for a, b in zip(before[table], after[table], strict=True))
        print(
            f"{table}: {updates / measured:.1f} updates a run, {hot / max(updates, 1):.0%} HOT,"
            f" {blocks / measured:.1f} index blocks touched a run"
        )
    for query in queries.captured_queries[:12]:
        print("   ", query["sql"][:110].replace("\n", " "))
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())


def insert_history(per_job: int) -> None:
    """Each job's `per_job` earlier runs, one a minute before its due instant, succeeded in
    20 ms with their one attempt, written set-based as bench.scale writes its history; then
    VACUUM (ANALYZE)."""
    from django.db import connection

    from bench.scale import _attempts, _key, _run_columns, table_names

    if per_job <= 0:
        return
    t = table_names()
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH run AS (
                {_run_columns(t)}
                SELECT gen_random_uuid(), v.job_id, v.id, 'scheduled', 'succeeded', at,
                       {_key("v.job_id", "at")}, 1, 1, '', '', at, at, at,
                       at + interval '1 ms', at + interval '20 ms', at + interval '20 ms',
                       0, 0, 0
                  FROM {t["version"]} AS v,
                       LATERAL (SELECT now() - g * interval '1 minute' AS at
                                  FROM generate_series(1, %(per_job)s) AS g) AS past
                RETURNING id, started_at, finished_at
            ){_attempts(t, "succeeded", "finished_at")}
            SELECT count(*) FROM run
            """,
            {"per_job": per_job},
        )
        cursor.execute("VACUUM (ANALYZE)")


TABLES = ("jobs_run", "jobs_attempt")


def table_figures() -> dict[str, tuple[int, int, int]]:
    """Table -> (rows updated, of which HOT, index blocks read or hit), so far. The
    process's own counts are flushed first (pg_stat_force_next_flush: at its next idle)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            """SELECT t.relname, t.n_tup_upd, t.n_tup_hot_upd,
                      COALESCE(io.idx_blks_read + io.idx_blks_hit, 0)
                 FROM pg_stat_user_tables AS t
                 JOIN pg_statio_user_tables AS io ON io.relid = t.relid
                WHERE t.relname = ANY(%s)""",
            [list(TABLES)],
        )
        return {name: tuple(values) for name, *values in cursor.fetchall()}


if __name__ == "__main__":
    main()
