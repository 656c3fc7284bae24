"""What partitions cost the scheduler's claim and its wake-up, by jobs and by due jobs.

    .venv/bin/python -m bench.profile_partitions [--cases 1000:100,200000:100,200000:20000]

For each case (jobs:due) on a fresh table: the jobs and their versions inserted by SQL (the
due ones due a second ago, the others spread over the next day), three replicas sharing 64
partitions (`partitions_run_once`), then, for one replica alone (no partitions) and for a
replica holding its third: the due-job claim (`_claim_due_jobs`, batch 500, rolled back)
and the wake-up query (`scheduler_next_due`), median and p99 over `--trials`, and the
claim's index entries visited (EXPLAIN ANALYZE). The claim should grow with due jobs, not
with jobs; a replica's share should cost about a third of the whole.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from bench.common import bench_environment
from bench.profile_materializer import create_jobs_in_bulk

BATCH = 500


def fill(owner, *, jobs: int, due: int) -> None:
    """`jobs` one-time jobs with their versions, `due` of them due: cloned in SQL from one
    made as job_create makes it."""
    from django.db import connection

    from jobs.clock import db_now
    from jobs.models import Job

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE jobs_job, jobs_jobversion, jobs_run CASCADE")
    now = db_now()
    create_jobs_in_bulk(owner, count=1, run_at=now, now=now)
    template_id = Job.objects.get().id
    columns = [field.column for field in Job._meta.concrete_fields]
    chosen = {
        "id": "gen_random_uuid()",
        "next_run_at": "CASE WHEN g <= %(due)s THEN now() - interval '1 second' "
        "ELSE now() + interval '1 second' * (g * 86400.0 / %(jobs)s) END",
    }
    select = ", ".join(chosen.get(column, f"template.{column}") for column in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH template AS (SELECT * FROM jobs_job),
                 made AS (INSERT INTO jobs_job ({", ".join(columns)})
                          SELECT {select} FROM template, generate_series(1, %(jobs)s) AS g
                          RETURNING id, spec, owner_id)
            INSERT INTO jobs_jobversion (job_id, version, spec, created_at, created_by_id)
            SELECT id, 1, spec, now(), owner_id FROM made
            """,
            {"jobs": jobs, "due": due},
        )  # fmt: skip
        cursor.execute(  # the template itself
            "WITH gone AS (DELETE FROM jobs_jobversion WHERE job_id = %(id)s)"
            " DELETE FROM jobs_job WHERE id = %(id)s",
            {"id": template_id},
        )
        cursor.execute("ANALYZE jobs_job")
        cursor.execute("ANALYZE jobs_jobversion")


def timed(call, trials: int) -> str:
    seconds = []
    for _ in range(trials):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    seconds.sort()
    p99 = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]
    return f"p50 {statistics.median(seconds) * 1000:7.2f} ms  p99 {p99 * 1000:7.2f} ms"


def claim_once(scope) -> int:
    from django.db import transaction

    from dispatch.materializer import _claim_due_jobs
    from jobs.clock import db_now

    with transaction.atomic():
        claimed = len(_claim_due_jobs(now=db_now(), limit=BATCH, scope=scope))
        transaction.set_rollback(True)
    return claimed


def entries_visited(scope) -> str:
    """The claim's index scan: rows it returned and rows its filter passed over."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        claim_once(scope)
    (sql,) = [query["sql"] for query in queries.captured_queries if "SKIP LOCKED" in query["sql"]]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT TEXT) {sql}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    returned = removed = 0
    scan_indent = None  # the indentation of the job_due_idx scan's node, while in it
    for line in plan.splitlines():
        indent = len(line) - len(line.lstrip())
        if "Index Scan using job_due_idx" in line:
            scan_indent = indent
            returned += int(re.search(r"actual time=\S+ rows=(\d+)", line).group(1))
        elif scan_indent is not None and indent <= scan_indent:
            scan_indent = None
        elif scan_indent is not None and "Rows Removed by Filter" in line:
            removed += int(line.split(":")[1])
    return f"job_due_idx: {returned} returned, {removed} passed over"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_partitions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cases", default="1000:100,200000:100,200000:20000")
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args()
    with bench_environment("benchpart", task_modules="tests.sample_tasks"):
        from django.contrib.auth import get_user_model

        from dispatch.partitions import PartitionsConfig, partitions_run_once
        from dispatch.scheduler import scheduler_next_due
        from jobs.clock import db_now

        owner = get_user_model().objects.create_user("bench")
        replicas = [PartitionsConfig(holder=name, lease_seconds=600) for name in "abc"]
        for case in args.cases.split(","):
            jobs, due = (int(part) for part in case.split(":"))
            fill(owner, jobs=jobs, due=due)
            held = {}
            for config in replicas + replicas:  # the second round hands the surplus over
                held[config.holder] = partitions_run_once(now=db_now(), config=config).held
            print(f"{jobs:,} jobs, {due:,} due; a holds {held['a']} of 64 partitions:")
            for label, scope in (("alone, unpartitioned", None), ("a's third", replicas[0].scope)):
                claimed = claim_once(scope)
                print(f"  {label:22} claim {timed(lambda s=scope: claim_once(s), args.trials)}"
                      f" ({claimed} claimed; {entries_visited(scope)})")  # fmt: skip
                wake = timed(lambda s=scope: scheduler_next_due(now=db_now(), scope=s), args.trials)
                print(f"  {'':22} next due {wake}")


if __name__ == "__main__":
    main()
