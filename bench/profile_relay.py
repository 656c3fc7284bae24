"""Relay benchmark and profile: how fast `relay_run_once` empties an outbox of N pending rows.

    .venv/bin/python -m bench.profile_relay --rows 10000 [--batch-size 1000] [--relays 2]
    .venv/bin/python -m bench.profile_relay --rows 10000 --profile 25   # + cProfile's top 25
    .venv/bin/python -m bench.profile_relay --latency 200   # one row at a time, idle relay
    .venv/bin/python -m bench.profile_relay --feed --rows 20000 --relays 2   # while written

Creates a fresh PostgreSQL database and RabbitMQ vhost (dropped afterwards), writes N queued
runs with their outbox rows (through jobs.outbox, as the scheduler does), then runs the
relay step in a loop until the outbox is empty, against the real broker with publisher
confirms, and prints rows/s. `--relays 2` runs two relay processes over the same rows
(SKIP LOCKED splits them). `--profile` repeats the single-relay drain on a second population
under cProfile and prints the functions that took the most time (cProfile slows Python
code down, so the rate printed without it is the figure to quote). `--latency N` starts a
real relay process (`manage.py relay`, idle, waiting on LISTEN with its 1 s poll as the
safety net), commits one outbox row at a time and times commit -> the message received by a
consumer of the queue. `--feed` starts `--relays` real relay processes, then writes the rows
in transactions of 1,000 runs with their outbox rows (a stand-in for the scheduler's bulk
pass, in this process) and times the first commit -> the outbox empty: runs created,
outboxed and confirmed per second, with the writer and relays sharing the machine. The
machine is shared: repeat a measurement (`--repeat`) and quote
the median.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time

from bench.common import ROOT, bench_environment, print_profile

# The bench's runs are manual (no occurrence to be unique on): they travel in the manual
# lane of `jobs` (jobs/lanes.py).
QUEUE = "jobs.manual"


def fill_outbox(rows: int, chunk: int = 5000) -> None:
    """N queued runs of one job, each with its pending outbox row, in a few bulk inserts."""
    import datetime as dt
    import uuid

    from django.contrib.auth import get_user_model
    from django.db import transaction

    from jobs.api.validation import JobSpecSerializer
    from jobs.clock import db_now
    from jobs.models import Job, Run, RunKind, RunState
    from jobs.outbox import outbox_enqueue_runs
    from jobs.services import job_create

    owner = get_user_model().objects.get_or_create(username="bench")[0]
    now = db_now()
    far = (now + dt.timedelta(days=365)).isoformat()  # never due: the runs are made here
    spec = JobSpecSerializer(
        data={
            "name": "relay bench",
            "task": "tests.record",
            "schedule": {"kind": "once", "run_at": far},
        }  # fmt: skip
    )
    spec.is_valid(raise_exception=True)
    job = Job.objects.filter(name="relay bench").first() or job_create(
        owner=owner, spec=spec.validated_data, now=now
    )
    version = job.versions.get()
    for start in range(0, rows, chunk):
        runs = [
            Run(
                job=job,
                job_version=version,
                kind=RunKind.MANUAL,
                state=RunState.QUEUED,
                scheduled_for=now,
                idempotency_key=f"bench-{uuid.uuid4()}",
                due_at=now,
                created_at=now,
            )
            for _ in range(min(chunk, rows - start))
        ]
        with transaction.atomic():
            Run.objects.bulk_create(runs)
            outbox_enqueue_runs(runs=runs, now=now)


def drain(batch_size: int) -> int:
    """Run relay steps until the outbox is empty; the rows this process published."""
    from django.conf import settings

    from dispatch.broker import ConfirmingPublisher
    from dispatch.relay import RelayConfig, relay_run_once
    from jobs.clock import db_now

    # No high-water mark: the bench measures publishing into a queue no worker drains.
    config = RelayConfig(batch_size=batch_size, high_water=None)
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    published = 0
    try:
        while True:
            result = relay_run_once(now=db_now(), config=config, publisher=publisher)
            published += result.published
            if not result.published:
                return published
    finally:
        publisher.close()


def _drain_in_child(batch_size: int, start, results) -> None:
    start.wait()
    results.put(drain(batch_size))


def timed_drain(rows: int, batch_size: int, relays: int) -> float:
    """Seconds the relays took to publish `rows` pending rows."""
    from django.db import connection

    from jobs.models import OutboxMessage

    fill_outbox(rows)
    pending = OutboxMessage.objects.filter(state="pending").count()
    if relays == 1:
        began = time.perf_counter()
        published = drain(batch_size)
        elapsed = time.perf_counter() - began
    else:
        connection.close()  # the children open their own
        context = multiprocessing.get_context("fork")
        start, results = context.Event(), context.Queue()
        children = [
            context.Process(target=_drain_in_child, args=(batch_size, start, results))
            for _ in range(relays)
        ]
        for child in children:
            child.start()
        time.sleep(1.0)  # let them connect first
        began = time.perf_counter()
        start.set()
        published = sum(results.get(timeout=600) for _ in children)
        elapsed = time.perf_counter() - began
        for child in children:
            child.join()
    assert published == pending, (published, pending)
    assert not OutboxMessage.objects.filter(state="pending").exists()
    purge()
    return elapsed


def purge() -> None:
    from django.conf import settings
    from kombu import Connection

    with Connection(settings.CELERY_BROKER_URL) as broker:
        broker.channel().queue_purge(QUEUE)


def start_relays(count: int, env: dict) -> list:
    import subprocess

    relays = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "relay"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(count)
    ]
    for relay in relays:
        assert relay.stdout.readline().strip() == b"relay started"
    return relays


def stop(relays: list) -> None:
    for relay in relays:
        relay.terminate()
    for relay in relays:
        relay.wait(30)


def feed(rows: int, relays: int, env: dict) -> tuple[float, float]:
    """(seconds to write the rows, seconds from the first commit to the outbox empty)."""
    from jobs.models import OutboxMessage

    processes = start_relays(relays, env)
    try:
        time.sleep(1.0)  # idle on LISTEN
        began = time.perf_counter()
        fill_outbox(rows, chunk=1000)
        written = time.perf_counter() - began
        while OutboxMessage.objects.exists():
            time.sleep(0.01)
        return written, time.perf_counter() - began
    finally:
        stop(processes)
        purge()


def latency(trials: int, env: dict) -> list[float]:
    """Seconds from the commit of one outbox row to its message reaching a consumer."""
    from celery import current_app
    from django.conf import settings
    from kombu import Connection

    relays = start_relays(1, env)
    seconds = []
    try:
        with Connection(settings.CELERY_BROKER_URL) as broker:
            queue = broker.SimpleQueue(current_app.amqp.queues[QUEUE], no_ack=True)
            for _ in range(trials):
                time.sleep(0.05)  # the relay is idle again, waiting on LISTEN
                fill_outbox(1)  # one run and its outbox row; the relays notified at commit
                committed = time.perf_counter()
                queue.get(timeout=10)
                seconds.append(time.perf_counter() - committed)
    finally:
        stop(relays)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_relay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=None, help="the relay's default")
    parser.add_argument("--relays", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, help="print the top N functions")
    parser.add_argument("--latency", type=int, default=0, help="time N single rows instead")
    parser.add_argument("--feed", action="store_true", help="relays drain while rows are written")
    args = parser.parse_args()

    with bench_environment("bench_relay", task_modules="tests.sample_tasks") as (env, _):
        from dispatch.relay import RelayConfig

        if args.latency:
            values = sorted(latency(args.latency, env))
            p = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
            print(
                f"relay latency, commit -> consumed, {args.latency} single rows: "
                f"p50 {p(0.5) * 1000:.1f} ms, p99 {p(0.99) * 1000:.1f} ms, "
                f"max {values[-1] * 1000:.1f} ms"
            )
            return
        if args.feed:
            for _ in range(args.repeat):
                written, drained = feed(args.rows, args.relays, env)
                print(
                    f"fed {args.rows} rows in {written:.2f}s ({args.rows / written:,.0f}/s) to "
                    f"{args.relays} relay process(es): outbox empty after {drained:.2f}s, "
                    f"{args.rows / drained:,.0f} runs/s created, outboxed and confirmed"
                )
            return

        batch_size = args.batch_size or RelayConfig.batch_size
        seconds = [timed_drain(args.rows, batch_size, args.relays) for _ in range(args.repeat)]
        rates = [args.rows / s for s in seconds]
        print(
            f"relay: {args.rows} rows, batch {batch_size}, {args.relays} relay(s): "
            f"median {statistics.median(rates):,.0f} rows/s "
            f"(runs: {', '.join(f'{r:,.0f}' for r in rates)})"
        )
        if args.profile:
            fill_outbox(args.rows)
            print_profile(lambda: drain(batch_size), args.profile)
            purge()


if __name__ == "__main__":
    main()
