"""Throughput per replica, each beside its floor in the same run (docs/scale.md).

    .venv/bin/python -m bench.replicas all --repeat 3
    .venv/bin/python -m bench.replicas scheduler --jobs 20000   # runs created per second
    .venv/bin/python -m bench.replicas promoter --jobs 20000    # pending runs queued per second
    .venv/bin/python -m bench.replicas relay --rows 20000       # rows published per second
    .venv/bin/python -m bench.replicas worker --runs 4000       # a worker's database path

One process does the work of one replica, in this process, on a fresh database and vhost
(bench.common), alternating with its floor `--repeat` times (medians are reported):
- scheduler: `scheduler_run_once` passes over a backlog of `--jobs` one-time jobs due now
  until none is left: runs (with their outbox rows) created per second. Floor: the same
  rows written by PostgreSQL alone, one INSERT ... SELECT a batch of 500 (the claim, the
  runs, the outbox rows, the jobs advanced): no Python, no policies.
- promoter: `promoter_run_once` over `--jobs` due `pending` runs (a jitter that has
  passed): runs queued (with their outbox rows) per second. Floor: the same update and
  outbox rows by SQL alone, 500 a statement.
- relay: `relay_run_once` steps over `--rows` pending outbox rows, with the broker's
  confirms, unpacked (tests.record) and packed (tests.record_packed, 20 runs a message):
  rows published per second. Floor: the same messages through the relay's own
  publisher (`ConfirmingPublisher`, confirms waited per batch of 1,000) without the
  database.
- worker: the worker's database path for a no-op handler (claim, outcome, log manifest;
  `run_execute_delivery`, packed: `run_execute_deliveries` 20 at a time), no Celery and no
  broker: runs per second in one process. Floor: one durable UPDATE of the run row a run.
Beside each rate: this process's CPU and its PostgreSQL backend's CPU (from /proc) per run,
the two costs a replica and a primary pay per run. Writes
var/bench/<UTC timestamp>-replicas-<mode>-<queue type>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
import uuid
from pathlib import Path

from bench.common import bench_environment, results_header, results_path, validated_spec
from bench.scale import insert_jobs, table_names

TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu() -> float:
    """CPU seconds (user + system) of this connection's PostgreSQL backend so far."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def measured(count: int, work) -> dict:
    """Run `work()`; its rate over `count` runs and its CPU (process, backend) per run."""
    backend, process, began = backend_cpu(), time.process_time(), time.perf_counter()
    work()
    seconds = time.perf_counter() - began
    process, backend = time.process_time() - process, backend_cpu() - backend
    return {
        "count": count,
        "seconds": seconds,
        "per_second": count / seconds,
        "process_cpu_ms": process / count * 1000,
        "backend_cpu_ms": backend / count * 1000,
    }


def vacuum() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE)")


def once_spec(task: str = "tests.record") -> dict:
    return validated_spec(
        {"name": "due", "task": task,
         "schedule": {"kind": "once", "run_at": "2035-01-01T00:00:00+00:00"}}
    )  # fmt: skip


# The spec's run_at is the job's due instant, as job_create writes it.
RUN_AT_DUE = """jsonb_set(spec, '{schedule,run_at}', to_jsonb(to_char(due AT TIME ZONE 'UTC',
                                                  'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')))"""


class Names:
    """Fresh job names per repetition."""

    def __init__(self) -> None:
        self.next = 1

    def due_jobs(self, count: int, task: str = "tests.record") -> None:
        """`count` one-time jobs due now (what job_create writes), set-based."""
        first, self.next = self.next, self.next + count
        for start in range(first, first + count, 100_000):
            insert_jobs(
                first=start, last=min(first + count, start + 100_000) - 1, name="due",
                spec=once_spec(task), due="now() - interval '1 second'", next_run_at="due",
                spec_sql=RUN_AT_DUE,
            )  # fmt: skip


# -- scheduler ----------------------------------------------------------------------------


def scheduler_product(count: int) -> dict:
    from dispatch.scheduler import SchedulerConfig, scheduler_run_once
    from jobs.clock import db_now

    created = []

    def work():
        while True:
            result = scheduler_run_once(now=db_now(), config=SchedulerConfig())
            created.append(result.runs_created)
            if not result.batch_full:
                return

    figures = measured(count, work)
    assert sum(created) == count, (sum(created), count)
    return figures


def scheduler_floor(count: int) -> dict:
    """The materializer's rows for `count` due jobs written by SQL alone, 500 a statement."""
    from django.db import connection

    t = table_names()
    sql = f"""
        WITH due AS (
            SELECT job.id, job.next_run_at AS at, version.id AS version_id, version.spec,
                   job.owner_id
              FROM {t["job"]} AS job
              JOIN {t["version"]} AS version
                ON version.job_id = job.id AND version.version = job.version
             WHERE job.state = 'active' AND job.next_run_at <= now()
             ORDER BY job.next_run_at LIMIT 500
               FOR UPDATE OF job SKIP LOCKED
        ), run AS (
            INSERT INTO {t["run"]} (id, job_id, job_version_id, kind, state, scheduled_for,
                   idempotency_key, fencing_token, attempt_count, failure_reason,
                   skip_reason, due_at, created_at, updated_at, duplicate_deliveries,
                   retry_base, republish_count)
            SELECT gen_random_uuid(), id, version_id, 'scheduled', 'queued', at,
                   id::text || ':' || to_char(at AT TIME ZONE 'UTC', 'YYYYMMDD"T"HH24MISS.US"Z"'),
                   0, 0, '', '', at, now(), now(), 0, 0, 0
              FROM due
            RETURNING id, job_id
        ), outbox AS (
            INSERT INTO {t["outbox"]} (run_id, message_id, task_name, queue, priority,
                   timeout_seconds, state, created_at, publish_tries, last_error, owner_id)
            SELECT run.id, gen_random_uuid(), due.spec ->> 'task', due.spec ->> 'queue',
                   (due.spec ->> 'priority')::int, (due.spec ->> 'timeout_seconds')::int,
                   'pending', now(), 0, '', due.owner_id
              FROM run JOIN due ON due.id = run.job_id
        ), advanced AS (
            UPDATE {t["job"]} AS job SET next_run_at = NULL FROM due WHERE job.id = due.id
        )
        SELECT count(*) FROM run
    """
    created = []

    def work():
        while True:
            with connection.cursor() as cursor:
                cursor.execute(sql)
                created.append(cursor.fetchone()[0])
            if created[-1] < 500:
                return

    figures = measured(count, work)
    assert sum(created) == count, (sum(created), count)
    return figures


def clear_runs() -> None:
    """Between repetitions: the runs and outbox rows made go (the jobs stay, done)."""
    from django.db import connection

    t = table_names()
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {t['outbox']}, {t['attempt']}, {t['run']} CASCADE")


def mode_scheduler(args, names: Names) -> dict:
    reps = []
    for _ in range(args.repeat):
        rep = {}
        for label, measure in (("product", scheduler_product), ("floor", scheduler_floor)):
            names.due_jobs(args.jobs)
            vacuum()
            rep[label] = measure(args.jobs)
            clear_runs()
        reps.append(rep)
        print(f"  scheduler: {rep['product']['per_second']:,.0f} runs/s, "
              f"floor {rep['floor']['per_second']:,.0f}/s", flush=True)  # fmt: skip
    return summarize(reps)


# -- promoter ---------------------------------------------------------------------------


def make_pending(names: Names, count: int) -> None:
    """`count` runs `pending` and due (as runs whose jitter has passed), no outbox rows."""
    from django.db import connection

    t = table_names()
    queued_runs(names, count, "tests.record")
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {t['outbox']}")
        cursor.execute(
            f"UPDATE {t['run']} SET state = 'pending', due_at = now() - interval '1 second'"
            " WHERE state = 'queued'"
        )
    vacuum()


def promoter_product(count: int) -> dict:
    from dispatch.promoter import PromoterConfig, promoter_run_once
    from jobs.clock import db_now

    released = []

    def work():
        while True:
            result = promoter_run_once(now=db_now(), config=PromoterConfig())
            released.append(result.runs_released)
            if not result.batch_full:
                return

    figures = measured(count, work)
    assert sum(released) == count, (sum(released), count)
    return figures


def promoter_floor(count: int) -> dict:
    """The promoter's writes for `count` due pending runs by SQL alone, 500 a statement."""
    from django.db import connection

    t = table_names()
    sql = f"""
        WITH due AS (
            SELECT id FROM {t["run"]} WHERE state = 'pending' AND due_at <= now()
             ORDER BY due_at LIMIT 500 FOR UPDATE SKIP LOCKED
        ), released AS (
            UPDATE {t["run"]} AS run SET state = 'queued', updated_at = now()
              FROM due WHERE run.id = due.id
            RETURNING run.id, run.job_version_id, run.job_id
        ), outbox AS (
            INSERT INTO {t["outbox"]} (run_id, message_id, task_name, queue, priority,
                   timeout_seconds, state, created_at, publish_tries, last_error, owner_id)
            SELECT released.id, gen_random_uuid(), version.spec ->> 'task',
                   version.spec ->> 'queue', (version.spec ->> 'priority')::int,
                   (version.spec ->> 'timeout_seconds')::int, 'pending', now(), 0, '',
                   job.owner_id
              FROM released JOIN {t["version"]} AS version
                ON version.id = released.job_version_id
              JOIN {t["job"]} AS job ON job.id = released.job_id
        )
        SELECT count(*) FROM released
    """
    released = []

    def work():
        while True:
            with connection.cursor() as cursor:
                cursor.execute(sql)
                released.append(cursor.fetchone()[0])
            if released[-1] < 500:
                return

    figures = measured(count, work)
    assert sum(released) == count, (sum(released), count)
    return figures


def mode_promoter(args, names: Names) -> dict:
    reps = []
    for _ in range(args.repeat):
        rep = {}
        for label, measure in (("product", promoter_product), ("floor", promoter_floor)):
            make_pending(names, args.jobs)
            rep[label] = measure(args.jobs)
            clear_runs()
        reps.append(rep)
        print(f"  promoter: {rep['product']['per_second']:,.0f} runs/s, "
              f"floor {rep['floor']['per_second']:,.0f}/s", flush=True)  # fmt: skip
    return summarize(reps)


# -- relay --------------------------------------------------------------------------------


def queued_runs(names: Names, count: int, task: str) -> list[str]:
    """`count` jobs due now, made into queued runs with their outbox rows by the
    materializer; their run ids."""
    from dispatch.scheduler import SchedulerConfig, scheduler_run_once
    from jobs.clock import db_now
    from jobs.models import Run, RunState

    names.due_jobs(count, task)
    while scheduler_run_once(now=db_now(), config=SchedulerConfig(batch_size=1000)).batch_full:
        pass
    vacuum()
    return [str(i) for i in Run.objects.filter(state=RunState.QUEUED).values_list("id", flat=True)]


def relay_product(count: int, publisher) -> dict:
    from dispatch.relay import RelayConfig, relay_run_once
    from jobs.clock import db_now

    published = []

    def work():
        while True:
            result = relay_run_once(now=db_now(), config=RelayConfig(), publisher=publisher)
            published.append(result.published)
            if not result.published:
                return

    figures = measured(count, work)
    assert sum(published) == count, (sum(published), count)
    return figures


def relay_floor(messages: list, publisher) -> dict:
    from dispatch.broker import published_at_text
    from dispatch.relay import RelayConfig

    batch = RelayConfig().batch_size

    def work():
        at = published_at_text(dt.datetime.now(dt.UTC))
        for start in range(0, len(messages), batch):
            publisher.publish_batch_and_confirm(
                messages[start : start + batch], published_at=at, timeout=15.0
            )

    return measured(len(messages), work)


def purge() -> None:
    from django.conf import settings
    from kombu import Connection

    with Connection(settings.CELERY_BROKER_URL) as broker:
        broker.default_channel.queue_purge("jobs")


def mode_relay(args, names: Names) -> dict:
    from django.conf import settings

    from dispatch.broker import ConfirmingPublisher
    from storage.outbox import PendingMessage

    out = {}
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        for task in ("tests.record", "tests.record_packed"):
            reps = []
            for _ in range(args.repeat):
                rep = {}
                run_ids = queued_runs(names, args.rows, task)
                rep["product"] = relay_product(len(run_ids), publisher)
                purge()
                messages = [
                    PendingMessage(id=index, message_id=uuid.uuid4(), run_id=uuid.UUID(run_id),
                                   task_name=task, queue="jobs", priority=0, timeout_seconds=None)
                    for index, run_id in enumerate(run_ids)
                ]  # fmt: skip
                rep["floor"] = relay_floor(messages, publisher)
                purge()
                clear_runs()
                reps.append(rep)
                print(f"  relay {task}: {rep['product']['per_second']:,.0f} rows/s, "
                      f"floor {rep['floor']['per_second']:,.0f}/s", flush=True)  # fmt: skip
            out[task] = summarize(reps)
    finally:
        publisher.close()
    return out


# -- worker -------------------------------------------------------------------------------


def worker_product(run_ids: list[str], pack: int) -> dict:
    from dispatch.worker import run_execute_deliveries, run_execute_delivery

    published = dt.datetime.now(dt.UTC).isoformat()

    def noop(ctx, *args, **kwargs):
        return None

    def work():
        if pack > 1:
            for start in range(0, len(run_ids), pack):
                run_execute_deliveries(
                    run_ids=run_ids[start : start + pack], handler=noop, worker="bench",
                    message_id=run_ids[start], published_at=published,
                )  # fmt: skip
            return
        for run_id in run_ids:
            run_execute_delivery(run_id=run_id, handler=noop, worker="bench",
                                 message_id=run_id, published_at=published)  # fmt: skip

    return measured(len(run_ids), work)


WARM_UP = 100  # runs the worker path delivers untimed first (connection, plans, caches)


def worker_floor(run_ids: list[str]) -> dict:
    """One durable UPDATE of the run row a run, autocommitted."""
    from django.db import connection

    t = table_names()

    def work():
        with connection.cursor() as cursor:
            for run_id in run_ids:
                cursor.execute(f"UPDATE {t['run']} SET updated_at = now() WHERE id = %s",
                               [run_id])  # fmt: skip

    return measured(len(run_ids), work)


def mode_worker(args, names: Names) -> dict:
    from jobs.models import Run, RunState

    out = {}
    for task, pack in (("tests.record", 1), ("tests.record_packed", 20)):
        reps = []
        for _ in range(args.repeat):
            rep = {}
            run_ids = queued_runs(names, args.runs + WARM_UP, task)
            worker_product(run_ids[:WARM_UP], pack)
            rep["floor"] = worker_floor(run_ids[WARM_UP:])
            rep["product"] = worker_product(run_ids[WARM_UP:], pack)
            done = Run.objects.filter(state=RunState.SUCCEEDED).count()
            assert done == len(run_ids), (done, len(run_ids))
            clear_runs()
            reps.append(rep)
            print(f"  worker {task}: {rep['product']['per_second']:,.0f} runs/s, "
                  f"floor {rep['floor']['per_second']:,.0f}/s", flush=True)  # fmt: skip
        out[task] = summarize(reps)
    return out


# -- figures ------------------------------------------------------------------------------


def summarize(reps: list[dict]) -> dict:
    median = {
        label: {key: statistics.median(rep[label][key] for rep in reps) for key in reps[0][label]}
        for label in reps[0]
    }
    ratios = [rep["product"]["per_second"] / rep["floor"]["per_second"] for rep in reps]
    return {"median": median, "ratio": statistics.median(ratios), "repetitions": reps}


def print_summary(results: dict) -> None:
    rows = [("measure", "product /s", "floor /s", "ratio", "cpu ms/run: process, backend")]
    flat = {}
    for mode, result in results.items():
        if "median" in result:
            flat[mode] = result
        else:
            flat |= {f"{mode} {task}": r for task, r in result.items()}
    for name, r in flat.items():
        p, f = r["median"]["product"], r["median"]["floor"]
        rows.append((name, f"{p['per_second']:,.0f}", f"{f['per_second']:,.0f}",
                     f"{r['ratio']:.2f}x",
                     f"{p['process_cpu_ms']:.3f}, {p['backend_cpu_ms']:.3f} "
                     f"(floor {f['process_cpu_ms']:.3f}, {f['backend_cpu_ms']:.3f})"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


MODES = {
    "scheduler": mode_scheduler,
    "promoter": mode_promoter,
    "relay": mode_relay,
    "worker": mode_worker,
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m bench.replicas",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("mode", choices=[*MODES, "all"])
    p.add_argument("--jobs", type=int, default=20_000, help="scheduler: due jobs")
    p.add_argument("--rows", type=int, default=20_000, help="relay: outbox rows")
    p.add_argument("--runs", type=int, default=4_000, help="worker: runs")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--queue-type", choices=["classic", "quorum"], default="classic",
                   help="SCHEDULER_QUEUE_TYPE of the vhost's queues (relay)")  # fmt: skip
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    output = args.output or results_path(started, f"-replicas-{args.mode}-{args.queue_type}")
    document = {
        **results_header(args, started),
        "results": {},
    }
    os.environ["SCHEDULER_QUEUE_TYPE"] = args.queue_type
    names = Names()
    modes = list(MODES) if args.mode == "all" else [args.mode]
    try:
        with bench_environment("benchrep", task_modules="tests.sample_tasks"):
            from bench.common import bench_owner

            bench_owner()
            for mode in modes:
                print(f"{mode} ...", flush=True)
                document["results"][mode] = MODES[mode](args, names)
    finally:
        document["finished"] = dt.datetime.now(dt.UTC).isoformat()
        document["host"]["load_average_after"] = os.getloadavg()
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print_summary(document["results"])
    print(f"written: {output}")
    return document


if __name__ == "__main__":
    main()
