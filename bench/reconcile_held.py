"""Reconciliation behind runs held back on purpose: how many passes (5 s apart in the loop)
it takes to publish again a run whose message was lost, with `--held` runs queued before
it whose messages still wait in the outbox (an owner at its limit, a paused queue).

    .venv/bin/python -m bench.reconcile_held [--held 100000] [--explain]

In one run, on one database: the lost run found with the marking of held runs off (the
walk over every queued run, as before the marking existed: the same-run baseline), then
with it on, cold (no run marked yet) and warm (a second run lost once the held ones are
marked). Default `ReconcileConfig` (scan_size 2,000, mark_size 20,000), the broker's
queue depths faked as empty (every examined published run is lost). Prints passes, the
detection time at 5 s a pass, and the passes' own time. Creates a fresh database and
vhost (dropped afterwards).
"""

from __future__ import annotations

import argparse
import logging
import time

from bench.common import bench_environment, bench_owner, validated_spec

POLL = 5.0  # ReconcileConfig.poll_interval: seconds between passes
MAX_PASSES = 1000


def _setup(held: int):
    """A job, `held` runs queued 2 h ago with their pending outbox rows, in one statement;
    returns the job."""
    from django.db import connection

    from jobs.clock import db_now
    from jobs.services import job_create

    owner = bench_owner()
    job = job_create(
        owner=owner,
        spec=validated_spec({"name": "held", "task": "tests.record",
                             "schedule": {"kind": "cron", "expression": "0 0 1 1 *"}}),
        now=db_now(),
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH run AS (
                INSERT INTO jobs_run (id, job_id, job_version_id, kind, state, scheduled_for,
                    idempotency_key, fencing_token, attempt_count, failure_reason,
                    skip_reason, due_at, created_at, updated_at, duplicate_deliveries,
                    retry_base, republish_count)
                SELECT gen_random_uuid(), %(job)s, v.id, 'manual', 'queued',
                       now() - interval '2 hours', 'held ' || g, 0, 0, '', '',
                       now() - interval '2 hours', now() - interval '2 hours',
                       now() - interval '2 hours' + g * interval '1 microsecond', 0, 0, 0
                  FROM generate_series(1, %(held)s) AS g
                  JOIN jobs_jobversion AS v ON v.job_id = %(job)s
                RETURNING id
            )
            INSERT INTO dispatch_outboxmessage (run_id, owner_id, message_id, task_name, queue,
                priority, state, created_at, publish_tries, last_error)
            SELECT run.id, %(owner)s, gen_random_uuid(), 'tests.record', 'jobs', 0, 'pending',
                   now() - interval '2 hours', 0, ''
              FROM run
            """,
            {"job": job.id, "owner": owner.id, "held": held},
        )
        cursor.execute("VACUUM ANALYZE jobs_run")
        cursor.execute("VACUUM ANALYZE dispatch_outboxmessage")
    return job


def _lost(job, name: str, ago: str):
    """A run published `ago` (an SQL interval) whose message was lost: no outbox row."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO jobs_run (id, job_id, job_version_id, kind, state, scheduled_for,
                idempotency_key, fencing_token, attempt_count, failure_reason, skip_reason,
                due_at, created_at, updated_at, duplicate_deliveries, retry_base,
                republish_count)
            SELECT gen_random_uuid(), %(job)s, v.id, 'manual', 'queued', now(), %(name)s, 0, 0,
                   '', '', now(), now() - %(ago)s::interval, now() - %(ago)s::interval, 0, 0, 0
              FROM jobs_jobversion AS v WHERE v.job_id = %(job)s
            RETURNING id
            """,
            {"job": job.id, "name": name, "ago": ago},
        )
        return cursor.fetchone()[0]


def _find(run_id, *, marking: bool) -> dict:
    """Passes until `run_id` is published again, from a new loop's window."""
    from dispatch import reconciler
    from dispatch.reconciler import ReconcileConfig, ReconcileWindow, reconcile_run_once
    from jobs.clock import db_now
    from jobs.models import Run

    mark = reconciler._mark_held
    if not marking:
        reconciler._mark_held = lambda **kwargs: 0
    try:
        window, spent, passes = ReconcileWindow(), 0.0, 0
        while passes < MAX_PASSES:
            passes += 1
            began = time.perf_counter()
            reconcile_run_once(
                now=db_now(), config=ReconcileConfig(), queue_depth=lambda q: 0, window=window
            )
            spent += time.perf_counter() - began
            if Run.objects.get(id=run_id).republish_count:
                break
    finally:
        reconciler._mark_held = mark
    return {"passes": passes, "detect_s": passes * POLL, "pass_ms": 1000 * spent / passes}


def _explain() -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of a warm window's statements and of the marking's."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from dispatch.reconciler import ReconcileConfig, ReconcileWindow, _mark_held, _window
    from jobs.clock import db_now

    with CaptureQueriesContext(connection) as queries:
        now, window = db_now(), ReconcileWindow()
        _mark_held(now=now, config=ReconcileConfig(), ids=None)
        _window(now=now, config=ReconcileConfig(), window=window)
        _window(now=now, config=ReconcileConfig(), window=window)
    plans = []
    for query in queries.captured_queries[1:]:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + query["sql"])
            plans.append("\n".join(row[0] for row in cursor.fetchall()))
            transaction.set_rollback(True)
    return plans


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--held", type=int, default=100_000)
    p.add_argument("--explain", action="store_true", help="print the warm pass's plans")
    args = p.parse_args(argv)
    logging.getLogger("dispatch.reconciler").setLevel(logging.CRITICAL)
    with bench_environment("benchrecon", task_modules="tests.sample_tasks"):
        job = _setup(args.held)
        results = {"marking off (baseline)": _find(_lost(job, "lost 1", "1 hour"),
                                                   marking=False)}  # fmt: skip
        results["marking on, cold"] = _find(_lost(job, "lost 2", "1 hour"), marking=True)
        results["marking on, warm"] = _find(_lost(job, "lost 3", "30 minutes"), marking=True)
        plans = _explain() if args.explain else []
    for text in plans:
        print(text, end="\n\n")
    print(f"{args.held:,} runs held back in the outbox, one lost run behind them:")
    for name, figures in results.items():
        print(f"  {name:24} {figures['passes']:4} passes = {figures['detect_s']:6.0f} s"
              f" at 5 s a pass; {figures['pass_ms']:7.1f} ms a pass")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
