"""The price of the state tallies' triggers (jobs/migrations/0002_tally_triggers.py) on the
hot path: the median time of the materializer's INSERT of 1,000 runs, of the relay's DELETE of
a batch of 1,000 outbox rows, of a claim's UPDATE of one run, and of `attempt_succeed`, with
the six triggers enabled and disabled (everything else alike, the histograms' triggers included).

    .venv/bin/python -m bench.state_tallies [--repeat 30]

Creates a fresh PostgreSQL database (dropped afterwards) and 1,000 queued runs with their
outbox rows through a real scheduler pass; each timed statement runs in a transaction that is
rolled back, so every repetition sees the same tables. The two modes alternate, so the
shared machine's noise falls on both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

from bench.common import bench_environment

RUNS = 1000


class Rollback(Exception):
    pass


def timed(step) -> float:
    """Seconds `step(cursor)` took inside a transaction rolled back afterwards."""
    from django.db import connection, transaction

    took = 0.0
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            took = step(cursor)
            raise Rollback
    except Rollback:
        pass
    return took


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.state_tallies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    with bench_environment("bench_tallies", task_modules="tests.sample_tasks"):
        from django.contrib.auth import get_user_model
        from django.db import connection

        from dispatch.scheduler import SchedulerConfig, scheduler_run_once
        from jobs.models import Run
        from jobs.services import job_create_bulk
        from jobs.transitions import attempt_succeed, run_claim
        from storage.tallies import STATE_TALLY_TRIGGERS
        from tests.factories import job_spec

        now = dt.datetime.now(dt.UTC)
        owner = get_user_model().objects.create_user("bench")
        specs = [
            job_spec(args=[n], schedule={"kind": "once", "run_at": now.isoformat()})
            for n in range(RUNS)
        ]
        job_create_bulk(owner=owner, specs=specs, now=now - dt.timedelta(seconds=1))
        scheduler_run_once(now=now, config=SchedulerConfig(batch_size=RUNS))
        assert Run.objects.count() == RUNS
        columns = [f.column for f in Run._meta.concrete_fields]
        copied = {
            "id": "gen_random_uuid()",
            "idempotency_key": "idempotency_key || '-copy'",
            "scheduled_for": "scheduled_for + interval '1 day'",
        }
        insert = (
            f"INSERT INTO jobs_run ({', '.join(columns)}) "
            f"SELECT {', '.join(copied.get(c, c) for c in columns)} FROM jobs_run"
        )
        run_ids = list(Run.objects.values_list("id", flat=True))

        def materialize(cursor) -> float:
            start = time.perf_counter()
            cursor.execute(insert)
            return time.perf_counter() - start

        def relay_delete(cursor) -> float:
            start = time.perf_counter()
            cursor.execute("DELETE FROM dispatch_outboxmessage WHERE state = 'pending'")
            return time.perf_counter() - start

        def claim(cursor, n=[0]) -> float:  # noqa: B006 - a counter across calls
            n[0] += 1
            start = time.perf_counter()
            assert run_claim(run_id=run_ids[n[0] % RUNS], worker="w", now=now, lease_seconds=60)
            return time.perf_counter() - start

        def succeed(cursor, n=[0]) -> float:  # noqa: B006
            n[0] += 1
            attempt = run_claim(run_id=run_ids[n[0] % RUNS], worker="w", now=now, lease_seconds=60)
            start = time.perf_counter()
            assert attempt_succeed(attempt=attempt, now=now)
            return time.perf_counter() - start

        def triggers(enabled: bool) -> None:
            with connection.cursor() as cursor:
                for name, table in STATE_TALLY_TRIGGERS:
                    action = "ENABLE" if enabled else "DISABLE"
                    cursor.execute(f"ALTER TABLE {table} {action} TRIGGER {name}")

        steps = {
            "materializer INSERT of 1,000 runs": materialize,
            "relay DELETE of 1,000 outbox rows": relay_delete,
            "run_claim (one run)": claim,
            "attempt_succeed (one run)": succeed,
        }
        figures = {(label, mode): [] for label in steps for mode in ("with", "without")}
        for _ in range(args.repeat):
            for mode in ("with", "without"):
                triggers(mode == "with")
                for label, step in steps.items():
                    figures[(label, mode)].append(timed(step))
        triggers(True)
        # The triggers' own time, as PostgreSQL reports it (EXPLAIN ANALYZE's "Triggers"),
        # for one run's state change and for an update that leaves the state alone.
        fired: dict[str, list[float]] = {}
        plans = {
            "one run's state change (queued -> running)": "UPDATE jobs_run SET state = 'running'"
            " WHERE id = %s",
            "one run's update, state unchanged": "UPDATE jobs_run SET updated_at = now()"
            " WHERE id = %s",
            "a DELETE of 1,000 outbox rows": "DELETE FROM dispatch_outboxmessage WHERE %s",
        }
        for n in range(args.repeat):
            for label, sql in plans.items():

                def explained(cursor, sql=sql, n=n) -> float:
                    param = True if "outbox" in sql else run_ids[n % RUNS]
                    cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", [param])
                    plan = cursor.fetchone()[0]
                    plan = plan[0] if isinstance(plan, list) else plan
                    return sum(
                        t["Time"] for t in plan.get("Triggers", []) if "tally" in t["Trigger Name"]
                    )

                fired.setdefault(label, []).append(timed(explained))
        print(f"medians of {args.repeat} (ms)     with triggers   without   difference")
        for label in steps:
            with_, without = (
                statistics.median(figures[(label, m)]) * 1000 for m in ("with", "without")
            )
            print(f"{label:36} {with_:9.3f} {without:9.3f} {with_ - without:+9.3f}")
        print(f"the state tallies' triggers alone (EXPLAIN ANALYZE), medians of {args.repeat} (ms)")
        for label, times in fired.items():
            print(f"{label:46} {statistics.median(times):9.3f}")


if __name__ == "__main__":
    main()
