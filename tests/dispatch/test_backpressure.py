"""Backpressure with real processes: with no worker, the relay fills the queue to its
high-water mark and stops while the rest wait in PostgreSQL; with workers, all run once."""

import collections
import datetime as dt
import threading
import time

import pytest
from django.conf import settings
from kombu import Connection

from jobs.models import OutboxMessage, Run, RunState
from jobs.services import job_create_bulk
from tests.factories import job_spec, owner
from tests.processes import wait_for

pytestmark = pytest.mark.slow

RUNS = 1500
HIGH_WATER = 200
BATCH = 100


class DepthSampler(threading.Thread):
    """Reads the queue's ready messages with a passive declare every few milliseconds."""

    def __init__(self, queue: str) -> None:
        super().__init__(daemon=True)
        self.queue = queue
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        with Connection(settings.CELERY_BROKER_URL) as broker:
            channel = broker.channel()
            while not self.done.is_set():
                try:
                    ok = channel.queue_declare(queue=self.queue, passive=True)
                except Exception:  # noqa: BLE001 - not declared by the relay yet
                    channel = broker.channel()
                else:
                    self.samples.append(ok.message_count)
                time.sleep(0.005)


def test_a_queue_without_consumers_fills_to_the_mark_and_the_rest_wait(stack, report_figure):
    """Two relays: each reads the depth then claims, so together they may pass the mark by
    one batch (docs/semantics.md), never more."""
    stack.scheduler()
    for relay in ("relay-1", "relay-2"):
        stack.relay(relay, "--batch-size", str(BATCH),
                    SCHEDULER_QUEUE_HIGH_WATER=str(HIGH_WATER))  # fmt: skip
        wait_for(lambda: b"relay started" in stack.log(relay), timeout=30, message=relay)  # noqa: B023
    sampler = DepthSampler("jobs")
    sampler.start()
    now = dt.datetime.now(dt.UTC)
    due = now + dt.timedelta(seconds=2)
    spec = job_spec(task="tests.record", schedule={"kind": "once", "run_at": due.isoformat()})
    jobs = job_create_bulk(owner=owner(), specs=[spec] * RUNS, now=now)
    try:
        wait_for(lambda: Run.objects.filter(job__in=jobs).count() == RUNS, timeout=60,
                 message="every run materialized")  # fmt: skip
        # The queue reaches its mark, then nothing more is published.
        wait_for(lambda: sampler.samples and sampler.samples[-1] >= HIGH_WATER, timeout=60,
                 message="the queue to reach its mark")  # fmt: skip
        time.sleep(3)
        pending = OutboxMessage.objects.count()
    finally:
        sampler.done.set()
        sampler.join()
    filled = max(sampler.samples)
    report_figure(
        f"two relays: ready messages at most {filled} (mark {HIGH_WATER}, batch {BATCH}), "
        f"{len(sampler.samples)} samples; {pending} runs waiting in the outbox"
    )
    assert filled <= HIGH_WATER + BATCH
    assert sampler.samples[-1] >= HIGH_WATER
    assert pending == RUNS - sampler.samples[-1]
    assert sampler.samples[-1] <= HIGH_WATER + BATCH
    assert stack.processes["relay-1"].poll() is None
    assert stack.processes["relay-2"].poll() is None

    # Workers drain the queue; the relay refills it as they do, until every run ran once.
    stack.worker("worker-1", concurrency=4)
    stack.worker("worker-2", concurrency=4)
    wait_for(
        lambda: Run.objects.filter(job__in=jobs, state=RunState.SUCCEEDED).count() == RUNS,
        timeout=300,
        message="every run to succeed",
    )
    executed = collections.Counter(
        e["run_id"] for e in stack.executions() if e["event"] == "executed"
    )
    assert len(executed) == RUNS
    assert set(executed.values()) == {1}
    assert not OutboxMessage.objects.exists()
