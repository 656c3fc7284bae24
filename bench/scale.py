"""Costs that grow with due work only: a scheduler pass with 1,000,000 jobs of which 100
are due, against the same pass with 1,000 jobs, in one run (docs/scale.md).

    .venv/bin/python -m bench.scale --jobs 1000000     # docs/scale.md's figure (~5 min here)
    .venv/bin/python -m bench.scale --quick            # 1,000 against 50,000: a check (~1 min)

Two databases of the product, the same in everything but their size:
- `--small` (1,000) or `--jobs` (1,000,000) daily cron jobs due 2 to 24 hours ahead, each
  with what job_create writes (the job, its first version, its audit event) and a history
  of one finished run (succeeded, with its attempt): the jobs and the finished runs are
  what grows;
- the same in-flight work in both: `--backlog` (1,000) runs queued and published 15
  minutes ago in a queue whose workers fell behind (`backlog`: the fake broker says it
  holds them all, so the reconciler leaves them be, as it should), and `--running` (100)
  runs running with a live lease.
Everything is written set-based (INSERT ... SELECT FROM generate_series, 100,000 jobs a
statement), then VACUUM (ANALYZE), as the W3 bench does: the jobs stand as jobs that have
been there a while.

Then `--passes` iterations at each size, alternating between the two databases in
`--rounds` rounds (the box is shared: both sizes meet the same noise). One iteration:
1. untimed: the previous pass's runs finish: their outbox rows deleted as the relay
   deletes them, each run claimed and completed by the worker's own path in this process
   (a no-op handler), and `--due` (100) one-time jobs due now are inserted;
2. timed: `scheduler_run_once` (the materializer makes the 100 runs, the promoter finds no
   due retry or pending run, the completer completes the previous pass's 100 jobs for as
   long as that is its job and not the run's end's; each step timed on its own too),
   `scheduler_next_due`, the reconciler's pass (`reconcile_run_once`, the broker's queue
   depths faked: no broker I/O is measured) and the reaper's pass (`reaper_run_once`).
Each pass must create exactly `--due` runs, leave no earlier per-pass job active, and the
reconciler and reaper must change nothing, or the bench says so. Then `--profile-passes`
(5) more iterations at each size count the shared buffers each top-level step touched
(pg_stat_database, flushed: the step's work whatever the box's load; a step inside a
transaction is not counted) and, for the last, time every statement. Prints median and p90
(ms) per step and size and the ratio of the medians, the buffers, and the statements over
`--statements` ms side by side; writes everything to
var/bench/<UTC timestamp>-scale-<jobs>.json. Both databases are dropped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common import (
    PG,
    bench_environment,
    bench_owner,
    quantile,
    results_header,
    results_path,
    validated_spec,
)

CHUNK = 100_000  # jobs (with their version, audit event, run and attempt) a statement
BACKLOG_QUEUE = "backlog"
STEPS = [
    ("pass", "scheduler pass (scheduler_run_once)"),
    ("materializer", "  materializer (100 due -> runs)"),
    ("promoter", "  promoter (nothing due)"),
    ("completer", "  completer (100 finished -> completed)"),
    ("next_due", "scheduler_next_due"),
    ("reconciler", "reconciler pass"),
    ("republish_lost_messages", "  published runs never claimed"),
    ("repair_orphaned_running", "  running runs without an attempt"),
    ("alarm_stuck_outbox", "  outbox rows pending too long"),
    ("reaper", "reaper pass (nothing expired)"),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--jobs", type=int, default=1_000_000, help="future jobs of the large size")
    p.add_argument("--small", type=int, default=1_000, help="future jobs of the small size")
    p.add_argument("--due", type=int, default=100, help="jobs falling due before each pass")
    p.add_argument("--passes", type=int, default=30, help="timed passes at each size")
    p.add_argument("--rounds", type=int, default=3, help="alternations between the sizes")
    p.add_argument("--backlog", type=int, default=1_000, help="queued runs waiting (both sizes)")
    p.add_argument("--running", type=int, default=100, help="running runs (both sizes)")
    p.add_argument("--statements", type=float, default=1.0,
                   help="print the profiled statements over this many ms")  # fmt: skip
    p.add_argument("--profile-passes", type=int, default=5,
                   help="more passes, counting the shared buffers each step touches")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="--jobs 50000 --passes 12: a check")
    p.add_argument("--output", type=Path, default=None, help="the JSON file to write")
    return p


# -- the databases ------------------------------------------------------------------------


def use_database(name: str) -> None:
    """Point Django's connection at database `name` (the next query connects)."""
    from django.db import connection

    connection.close()
    connection.settings_dict["NAME"] = name


def psql(sql: str) -> None:
    subprocess.run(["psql", f"{PG}/postgres", "-qc", sql], check=True)


def table_names() -> dict[str, str]:
    from jobs.models import Attempt, AuditEvent, Job, JobVersion, OutboxMessage, Run

    models = {"job": Job, "version": JobVersion, "audit": AuditEvent, "run": Run}
    models |= {"attempt": Attempt, "outbox": OutboxMessage}
    return {key: model._meta.db_table for key, model in models.items()}


def insert_jobs(
    *,
    first: int,
    last: int,
    name: str,
    spec: dict,
    due: str,
    next_run_at: str,
    spec_sql: str = "spec",
    runs: str = "",
) -> None:
    """Jobs `first`..`last` named "<name> <g>", as job_create writes them (job, version 1,
    `job.created` audit event), in one statement. `due` is an SQL expression of g (the
    series) and now(); `next_run_at` and `spec_sql` SQL of `due` and of `spec` (the
    template's jsonb with its name set); `runs`, more data-modifying CTEs that read `job`
    and `version` (the jobs' runs and attempts)."""
    from django.db import connection

    from jobs.audit import actor_label

    owner = bench_owner()
    t = table_names()
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH series AS (
                SELECT g, {due} AS due,
                       jsonb_set(%(spec)s::jsonb, '{{name}}', to_jsonb(%(name)s || ' ' || g))
                       AS spec
                  FROM generate_series(%(first)s::int, %(last)s::int) AS g
            ), job AS (
                INSERT INTO {t["job"]} (id, owner_id, name, task, state, version, spec, queue,
                                        priority, labels, next_run_at, created_at, updated_at)
                SELECT gen_random_uuid(), %(owner)s, %(name)s || ' ' || g, %(task)s, 'active',
                       1, {spec_sql}, %(queue)s, %(priority)s, %(labels)s::jsonb,
                       {next_run_at}, now(), now()
                  FROM series
                RETURNING id, spec, created_at, owner_id, next_run_at
            ), version AS (
                INSERT INTO {t["version"]} (job_id, version, spec, created_at, created_by_id)
                SELECT id, 1, spec, created_at, owner_id FROM job
                RETURNING id, job_id
            ), audit AS (
                INSERT INTO {t["audit"]} (created_at, actor_id, actor_label, action, job_id,
                                          data)
                SELECT created_at, owner_id, %(actor)s, 'job.created', id,
                       '{{"version": 1}}'::jsonb
                  FROM job
            ){runs}
            SELECT count(*) FROM version
            """,
            {
                "spec": json.dumps(spec),
                "name": name,
                "first": first,
                "last": last,
                "owner": owner.pk,
                "task": spec["task"],
                "queue": spec["queue"],
                "priority": spec["priority"],
                "labels": json.dumps(spec["labels"]),
                "actor": actor_label(owner),
            },
        )


def _run_columns(t: dict) -> str:
    return f"""INSERT INTO {t["run"]} (id, job_id, job_version_id, kind, state, scheduled_for,
                       idempotency_key, fencing_token, attempt_count, failure_reason,
                       skip_reason, due_at, created_at, published_at, started_at,
                       finished_at, updated_at, duplicate_deliveries, retry_base,
                       republish_count)"""


def _key(job_id: str, at: str) -> str:
    """SQL: jobs.keys.occurrence_key."""
    return f"""{job_id}::text || ':' || to_char({at} AT TIME ZONE 'UTC',
                                                   'YYYYMMDD"T"HH24MISS.US"Z"')"""


def _attempts(t: dict, state: str, lease: str) -> str:
    return f""", attempt AS (
                INSERT INTO {t["attempt"]} (run_id, number, fencing_token, state, worker,
                       task_id, lease_expires_at, heartbeat_at, started_at, finished_at, error)
                SELECT id, 1, 1, '{state}', 'bench', '', {lease}, started_at, started_at,
                       finished_at, ''
                  FROM run
            )"""


def load(*, jobs: int, backlog: int, running: int) -> dict:
    """Fill the current database (see the module's docstring); seconds each part took."""
    from django.db import connection

    t = table_names()
    cron = validated_spec(
        {"name": "cron", "task": "tests.record",
         "schedule": {"kind": "cron", "expression": "0 3 * * *"}}
    )  # fmt: skip
    once = validated_spec(
        {"name": "once", "task": "tests.record", "queue": BACKLOG_QUEUE,
         "schedule": {"kind": "once", "run_at": "2035-01-01T00:00:00+00:00"}}
    )  # fmt: skip
    seconds = {}
    began = time.monotonic()
    # Daily cron jobs at a minute 2 to 24 hours ahead (never due during the bench), each
    # with yesterday's run, succeeded.
    history = f""", run AS (
                {_run_columns(t)}
                SELECT gen_random_uuid(), version.job_id, version.id, 'scheduled', 'succeeded',
                       at, {_key("version.job_id", "at")}, 1, 1, '', '', at, at,
                       at + interval '5 ms', at + interval '20 ms', at + interval '120 ms',
                       at + interval '120 ms', 0, 0, 0
                  FROM version JOIN job ON job.id = version.job_id,
                       LATERAL (SELECT job.next_run_at - interval '1 day' AS at) y
                RETURNING id, started_at, finished_at
            ){_attempts(t, "succeeded", "finished_at")}"""
    for first in range(1, jobs + 1, CHUNK):
        insert_jobs(
            first=first, last=min(jobs, first + CHUNK - 1), name="future", spec=cron,
            due="date_trunc('minute', now() + interval '2 hours'"
                " + random() * interval '22 hours')",
            next_run_at="due",
            # The expression that fires at `due` (UTC, the spec's zone).
            spec_sql="""jsonb_set(spec, '{schedule,expression}',
                          to_jsonb(to_char(due AT TIME ZONE 'UTC', 'FMMI FMHH24') || ' * * *'))""",
            runs=history,
        )  # fmt: skip
        print(f"  {min(jobs, first + CHUNK - 1):>9,} future jobs", flush=True)
    seconds["future_jobs"] = time.monotonic() - began
    began = time.monotonic()
    # In flight, the same at both sizes: a backlog of runs published 15 minutes ago that no
    # worker has claimed yet, and runs running with a live lease.
    queued = f""", run AS (
                {_run_columns(t)}
                SELECT gen_random_uuid(), version.job_id, version.id, 'scheduled', 'queued',
                       at, {_key("version.job_id", "at")}, 0, 0, '', '', at, at,
                       at + interval '10 ms', NULL, NULL, at + interval '10 ms', 0, 0, 0
                  FROM version, LATERAL (SELECT now() - interval '15 minutes' AS at) y
            )"""
    insert_jobs(first=1, last=backlog, name="backlog", spec=once, due="now()",
                next_run_at="NULL", runs=queued)  # fmt: skip
    live = f""", run AS (
                {_run_columns(t)}
                SELECT gen_random_uuid(), version.job_id, version.id, 'scheduled', 'running',
                       at, {_key("version.job_id", "at")}, 1, 1, '', '', at, at,
                       at + interval '10 ms', at + interval '20 ms', NULL,
                       at + interval '20 ms', 0, 0, 0
                  FROM version, LATERAL (SELECT now() - interval '10 seconds' AS at) y
                RETURNING id, started_at, finished_at
            ){_attempts(t, "running", "now() + interval '1 day'")}"""
    # In the default queue: their claims are not "later messages claimed" of the backlog's.
    insert_jobs(first=1, last=running, name="running", spec={**once, "queue": "jobs"}, due="now()",
                next_run_at="NULL", runs=live)  # fmt: skip
    seconds["in_flight"] = time.monotonic() - began
    began = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE)")
    seconds["vacuum_analyze"] = time.monotonic() - began
    return seconds


def counts() -> dict:
    """Rows and bytes (with indexes and TOAST) of each table, and of the database."""
    from django.db import connection

    out = {}
    with connection.cursor() as cursor:
        for key, table in table_names().items():
            cursor.execute(f"SELECT count(*), pg_total_relation_size('{table}') FROM {table}")
            out[f"{key}_rows"], out[f"{key}_bytes"] = cursor.fetchone()
        cursor.execute("SELECT pg_database_size(current_database())")
        out["database_bytes"] = cursor.fetchone()[0]
    return out


# -- one iteration ------------------------------------------------------------------------


def _noop(ctx, *args, **kwargs):
    return None


def finish_published() -> int:
    """The runs that have outbox rows (the last pass's) are published and run: their rows
    deleted as the relay deletes them (`outbox_delete_published`), each run claimed, run (a
    no-op) and completed by the worker's own path (`run_execute_delivery`), so whatever the
    product does at a run's end happens as it does in production. Returns how many."""
    from django.db import transaction

    from dispatch.worker import run_execute_delivery
    from jobs.clock import db_now
    from jobs.models import OutboxMessage
    from jobs.outbox import outbox_delete_published

    rows = list(OutboxMessage.objects.values_list("id", "run_id", "message_id"))
    with transaction.atomic():
        outbox_delete_published(message_ids=[row[0] for row in rows])
    published_at = db_now().isoformat()
    for _, run_id, message_id in rows:
        run_execute_delivery(run_id=str(run_id), handler=_noop, worker="bench",
                             message_id=str(message_id), published_at=published_at)  # fmt: skip
    return len(rows)


def unfinished_due_jobs() -> int:
    """The per-pass one-time jobs still active after their run: after a pass, only that
    pass's (their runs are queued), whichever step completes a finished job."""
    from jobs.models import Job, JobState

    return Job.objects.filter(
        state=JobState.ACTIVE, next_run_at__isnull=True, name__startswith="due "
    ).count()


class Serial:
    """The numbers of the per-pass jobs, so that their names stay unique per database."""

    def __init__(self) -> None:
        self.next = {}

    def take(self, database: str, count: int) -> tuple[int, int]:
        first = self.next.get(database, 1)
        self.next[database] = first + count
        return first, first + count - 1


class StepTimer:
    """Wraps the steps of a pass (module-level functions, looked up by name when called) to
    time each. A step absent from its module (renamed by a later change) is not timed."""

    STEPS = {
        "dispatch.scheduler": ["materializer_run_once", "promoter_run_once", "completer_run_once"],
        # The reconciler's parts, today's names: after a rewrite, only the pass is timed.
        "dispatch.reconciler": [
            "_republish_lost_messages",
            "_repair_orphaned_running",
            "_alarm_stuck_outbox",
        ],
    }

    def __init__(self) -> None:
        import importlib

        self.times: dict[str, float] = {}
        self.stack: list[str] = []
        # (step, statement, seconds) of every statement, while a list (--statements).
        self.statements: list[tuple[str, str, float]] | None = None
        # step -> shared buffers it touched, while a dict (the profiled iterations).
        self.blocks: dict[str, int] | None = None
        self.reading = False
        for module_name, names in self.STEPS.items():
            module = importlib.import_module(module_name)
            for attr in names:
                if callable(getattr(module, attr, None)):
                    name = attr.strip("_").removesuffix("_run_once")
                    setattr(module, attr, self._timed(name, getattr(module, attr)))

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        from django.db import connection

        # Inside a transaction the counts are not flushed: only top-level steps count.
        counted = self.blocks is not None and not connection.in_atomic_block
        blocks = self._blocks() if counted else None
        self.stack.append(name)
        began = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = time.perf_counter() - began
            self.stack.pop()
            if blocks is not None:
                self.blocks[name] = self._blocks() - blocks

    def _blocks(self) -> int:
        """Shared buffers read or hit in the current database so far (pg_stat_database,
        flushed first): the work of a step, whatever the load of the box."""
        from django.db import connection

        self.reading = True
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_stat_force_next_flush()")  # at the next idle
                cursor.execute("SELECT pg_stat_clear_snapshot()")
                cursor.execute(
                    "SELECT blks_hit + blks_read FROM pg_stat_database"
                    " WHERE datname = current_database()"
                )
                return cursor.fetchone()[0]
        finally:
            self.reading = False

    def _timed(self, name: str, function):
        def timed(*args, **kwargs):
            with self.step(name):
                return function(*args, **kwargs)

        return timed

    def execute(self, execute, sql, params, many, context):
        """A Django execute wrapper: each statement's time, under the innermost step."""
        began = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            if self.statements is not None and self.stack and not self.reading:
                text = " ".join(sql.split())
                self.statements.append((self.stack[-1], text, time.perf_counter() - began))


def iteration(*, database: str, serial: Serial, timer: StepTimer, args) -> dict:
    """One prepared and timed iteration (the module's docstring); seconds per step."""
    from dispatch.reaper import ReaperConfig, reaper_run_once
    from dispatch.reconciler import ReconcileConfig, ReconcileWindow, reconcile_run_once
    from dispatch.scheduler import SchedulerConfig, scheduler_next_due, scheduler_run_once
    from jobs.clock import db_now

    finished = finish_published()
    first, last = serial.take(database, args.due)
    once = validated_spec(
        {"name": "due", "task": "tests.record",
         "schedule": {"kind": "once", "run_at": "2035-01-01T00:00:00+00:00"}}
    )  # fmt: skip
    insert_jobs(first=first, last=last, name="due", spec=once, due="now()",
                next_run_at="due", spec_sql="""jsonb_set(spec, '{schedule,run_at}',
                    to_jsonb(to_char(due AT TIME ZONE 'UTC',
                                     'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')))""")  # fmt: skip
    timer.times.clear()
    # Each step is timed from after its db_now() (the loops read the clock too, but that
    # round trip is not the step's cost).
    now = db_now()
    with timer.step("pass"):
        result = scheduler_run_once(now=now, config=SchedulerConfig())
    now = db_now()
    with timer.step("next_due"):
        scheduler_next_due(now=now)
    now = db_now()
    with timer.step("reconciler"):
        reconciled = reconcile_run_once(
            now=now,
            config=ReconcileConfig(),
            queue_depth=lambda _queue: args.backlog,
            window=ReconcileWindow(),  # a first pass's walk: from the oldest queued run
        )
    now = db_now()
    with timer.step("reaper"):
        reaped = reaper_run_once(now=now, config=ReaperConfig())
    return {
        "seconds": dict(timer.times),
        "runs_created": result.runs_created,
        "jobs_completed": result.jobs_completed,
        "finished_before": finished,
        "unfinished_jobs": unfinished_due_jobs(),
        "republished": reconciled.republished + reconciled.undeliverable,
        "orphans": reconciled.orphans_repaired,
        "reaped": reaped.lost + reaped.timed_out + reaped.released,
    }


def profile(*, database: str, serial: Serial, timer: StepTimer, args) -> dict:
    """`--profile-passes` more iterations, with the shared buffers each step touched
    (median over them) and, of the last, every statement's time."""
    from django.db import connection

    blocks = []
    try:
        for index in range(args.profile_passes):
            timer.blocks = {}
            timer.statements = [] if index == args.profile_passes - 1 else None
            with connection.execute_wrapper(timer.execute):
                iteration(database=database, serial=serial, timer=timer, args=args)
            blocks.append(timer.blocks)
        statements = [(step, sql, seconds * 1000) for step, sql, seconds in timer.statements]
    finally:
        timer.statements = timer.blocks = None
    steps = [step for step, _ in STEPS if all(step in b for b in blocks)]
    return {
        "blocks": {step: statistics.median(b[step] for b in blocks) for step in steps},
        "statements": statements,
    }


def print_blocks(document: dict) -> None:
    small, large = (document["results"][size].get("blocks") for size in document["sizes"])
    if not small or not large:
        return
    print("\nshared buffers touched (hit or read) per step, median of the profiled passes:")
    for step, label in STEPS:
        if step in small and step in large:
            ratio = f"{large[step] / small[step]:.2f}x" if small[step] else "n/a"
            print(f"  {label:<40} {small[step]:>9,.0f} {large[step]:>9,.0f}  {ratio}")


def print_statements(document: dict, least_ms: float) -> None:
    """Side by side, the statements of the profiled iteration at both sizes (the same
    statements in the same order, unless a size took another path)."""
    small, large = (document["results"][size].get("statements") for size in document["sizes"])
    print_blocks(document)
    if not small or not large:
        return
    print(f"\nstatements of one more iteration, those over {least_ms} ms at either size:")
    if [(s, q[:60]) for s, q, _ in small] != [(s, q[:60]) for s, q, _ in large]:
        print("  (the two sizes ran different statements: see the JSON)")
        return
    for (step, sql, a), (_, _, b) in zip(small, large, strict=True):
        if max(a, b) >= least_ms:
            print(f"  {step:<24} {a:8.2f} ms {b:8.2f} ms {b / a:6.2f}x  {sql[:90]}")


# -- figures ------------------------------------------------------------------------------


def step_figures(iterations: list[dict]) -> dict:
    figures = {}
    for step, _ in STEPS:
        values = [it["seconds"][step] for it in iterations if step in it["seconds"]]
        figures[step] = {
            "n": len(values),
            "median_ms": statistics.median(values) * 1000 if values else None,
            "p90_ms": quantile(values, 0.9) * 1000 if values else None,
            "max_ms": max(values) * 1000 if values else None,
        }
    return figures


def anomalies(iterations: list[dict], due: int) -> list[str]:
    out = []
    for index, it in enumerate(iterations):
        if it["runs_created"] != due:
            out.append(f"pass {index}: {it['runs_created']} runs created, not {due}")
        if it["unfinished_jobs"] != due:
            out.append(f"pass {index}: {it['unfinished_jobs']} one-time jobs active after "
                       f"their run, not {due}")  # fmt: skip
        for key in ("republished", "orphans", "reaped"):
            if it[key]:
                out.append(f"pass {index}: {key} {it[key]}")
    return out


def print_table(document: dict) -> None:
    small, large = document["sizes"]
    fs, fl = (document["results"][size]["steps"] for size in (small, large))
    head = ("step", f"{int(small):,} jobs: median / p90", f"{int(large):,} jobs: median / p90",
            "ratio of medians")  # fmt: skip
    table = [head]
    for step, label in STEPS:
        a, b = fs[step], fl[step]
        if a["median_ms"] is None or b["median_ms"] is None:
            continue
        table.append((label, f"{a['median_ms']:.2f} / {a['p90_ms']:.2f} ms",
                      f"{b['median_ms']:.2f} / {b['p90_ms']:.2f} ms",
                      f"{b['median_ms'] / a['median_ms']:.2f}x"))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for index, row in enumerate(table):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def write(document: dict, output: Path) -> None:
    document["finished"] = dt.datetime.now(dt.UTC).isoformat()
    document["host"]["load_average_after"] = os.getloadavg()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.quick:
        args.jobs, args.passes = min(args.jobs, 50_000), min(args.passes, 12)
    if args.jobs <= args.small or args.passes < args.rounds or args.due < 1:
        raise SystemExit("need --jobs > --small, --passes >= --rounds and --due >= 1")
    started = dt.datetime.now(dt.UTC)
    output = args.output or results_path(started, f"-scale-{args.jobs}")
    document = {
        **results_header(args, started),
        "sizes": [str(args.small), str(args.jobs)],
        "results": {},
    }
    os.environ["SCHEDULER_QUEUES"] = f"jobs,{BACKLOG_QUEUE}"
    with bench_environment("benchscale", task_modules="tests.sample_tasks") as (env, _workdir):
        small_db = env["DATABASE_URL"].rsplit("/", 1)[1]
        large_db = f"{small_db}_large"
        bench_owner()  # in the template, so the same owner in both
        use_database(small_db)  # closes the connection: a template must have none
        psql(f"CREATE DATABASE {large_db} TEMPLATE {small_db}")
        try:
            databases = {str(args.small): small_db, str(args.jobs): large_db}
            sizes = {str(args.small): args.small, str(args.jobs): args.jobs}
            for size, database in databases.items():
                use_database(database)
                print(f"loading {database}: {sizes[size]:,} future jobs ...", flush=True)
                seconds = load(jobs=sizes[size], backlog=args.backlog, running=args.running)
                document["results"][size] = {"load_seconds": seconds, "iterations": []}
                tables = document["results"][size]["tables"] = counts()
                print(f"  loaded in {sum(seconds.values()):.0f} s: {tables['job_rows']:,} jobs, "
                      f"{tables['run_rows']:,} runs, {tables['database_bytes'] / 1e6:,.0f} MB",
                      flush=True)  # fmt: skip
                write(document, output)
            serial, timer = Serial(), StepTimer()
            per_round = [args.passes // args.rounds + (r < args.passes % args.rounds)
                         for r in range(args.rounds)]  # fmt: skip
            for round_index, passes in enumerate(per_round):
                for size, database in databases.items():
                    use_database(database)
                    # Untimed: connects, and completes what the last round left.
                    iteration(database=database, serial=serial, timer=timer, args=args)
                    for _ in range(passes):
                        document["results"][size]["iterations"].append(
                            iteration(database=database, serial=serial, timer=timer, args=args)
                        )
                    print(f"  round {round_index + 1}/{args.rounds}: {passes} passes at "
                          f"{int(size):,} jobs", flush=True)  # fmt: skip
            for size, database in databases.items():
                use_database(database)
                document["results"][size] |= profile(
                    database=database, serial=serial, timer=timer, args=args
                )
            for size in databases:
                result = document["results"][size]
                result["steps"] = step_figures(result["iterations"])
                result["anomalies"] = anomalies(result["iterations"], args.due)
            small, large = (document["results"][size]["steps"] for size in databases)
            document["ratios"] = {
                step: large[step]["median_ms"] / small[step]["median_ms"]
                for step, _ in STEPS
                if large[step]["median_ms"] and small[step]["median_ms"]
            }
        except BaseException as exc:
            document["error"] = repr(exc)
            raise
        finally:
            write(document, output)
            use_database(small_db)  # bench_environment closes it and drops its database
            psql(f"DROP DATABASE IF EXISTS {large_db} WITH (FORCE)")
    print_table(document)
    print_statements(document, args.statements)
    for size in document["sizes"]:
        for line in document["results"][size].get("anomalies", []):
            print(f"  {int(size):,} jobs, {line}")
    print(f"written: {output}")
    return document


if __name__ == "__main__":
    main()
