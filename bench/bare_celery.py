"""Bare Celery on the same broker: the baseline a benchmark reports its figures against.

A plain Celery app (no Django, no database) whose task does nothing but note when it
started. Its workers get the options the product's workers get (JSON, persistent messages,
prefetch 1, the same pool, count and concurrency), so the ratio of the two measures what
the product adds: durable runs, leases, outcomes, logs. Acknowledgement is late by default
(the baseline's definition; `acks_late=False` matches the product's early acks).

    celery -A bench.bare_celery worker -Q bare   # started by `bare_celery_burst`, from the root
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from celery import Celery

QUEUE = "bare"
ROOT = Path(__file__).resolve().parent.parent

app = Celery("bare_celery", broker=os.environ.get("CELERY_BROKER_URL", "amqp://localhost"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=QUEUE,
    task_default_delivery_mode="persistent",
    task_acks_late=os.environ.get("BARE_ACKS_LATE", "true") == "true",
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
)


@app.task(name="bare.noop")
def noop() -> None:
    # One short O_APPEND write per task: atomic between the pool's processes.
    fd = os.open(os.environ["BARE_RECORD"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{time.time()}\n".encode())
    finally:
        os.close(fd)


def _starts(record: Path) -> list[float]:
    return [float(line) for line in record.read_text().split()] if record.exists() else []


def _wait_for(record: Path, count: int, timeout: float) -> list[float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        starts = _starts(record)
        if len(starts) >= count:
            return starts
        time.sleep(0.2)
    raise TimeoutError(f"bare Celery ran {len(_starts(record))} of {count} tasks in {timeout}s")


def bare_celery_burst(
    *,
    tasks: int,
    workers: int,
    concurrency: int,
    pool: str,
    broker_url: str,
    workdir: Path,
    acks_late: bool = True,
) -> dict:
    """Publish `tasks` no-ops at once to running workers; the last start after the first
    publish (seconds, the drain time) and the start rate between the first and the last
    start (tasks/s)."""
    from bench.common import RoleCpu

    record = workdir / "bare-starts.txt"
    # Without DJANGO_SETTINGS_MODULE: Celery's Django fix-up would set Django up per worker.
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        CELERY_BROKER_URL=broker_url,
        BARE_RECORD=str(record),
        BARE_ACKS_LATE="true" if acks_late else "false",
    )
    app.conf.broker_url = broker_url
    log = open(workdir / "bare-workers.log", "ab")  # noqa: SIM115
    argv = [sys.executable, "-m", "celery", "-A", "bench.bare_celery", "worker", "-Q", QUEUE,
            f"--concurrency={concurrency}", f"--pool={pool}", "--loglevel=WARNING",
            "--without-gossip", "--without-mingle"]  # fmt: skip
    processes = [
        subprocess.Popen(
            [*argv, "-n", f"bare{index}@%h"], env=env, cwd=ROOT, stdout=log, stderr=log
        )  # fmt: skip
        for index in range(workers)
    ]
    try:
        # Warm up: every pool process has started and consumed before the clock starts.
        for _ in range(workers * concurrency * 2):
            noop.apply_async()
        _wait_for(record, workers * concurrency * 2, timeout=120)
        record.unlink()
        cpu = RoleCpu({"worker": [process.pid for process in processes]}, database=None)
        first_publish = time.time()
        for _ in range(tasks):
            noop.apply_async()
        published = time.time()
        starts = _wait_for(record, tasks, timeout=600)
        spent = cpu.spent()
        span = max(starts) - min(starts)
        return {
            "tasks": tasks,
            "acks_late": acks_late,
            "publish_seconds": published - first_publish,
            "last_start": max(starts) - first_publish,
            "throughput": (len(starts) - 1) / max(span, 1e-9),
            "cpu_seconds": spent,
        }
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
        log.close()
