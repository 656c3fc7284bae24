"""Log content through Django's storage interface, on two backends configured the way an
operator would (STORAGES["scheduler_logs"]): FileSystemStorage in a directory of the test's,
and django-storages' S3Storage against moto's in-process S3. A chunk above the inline size
goes to the backend, reads back through the API, and retention deletes it there."""

from __future__ import annotations

import datetime as dt
import threading
import time

import boto3
import moto
import pytest
from django.conf import settings as django_settings
from django.core.files.storage import storages
from django.db import connection, transaction

from dispatch.reaper import ReaperConfig, reaper_run_once
from dispatch.worker import run_execute_delivery
from jobs.clock import db_now
from jobs.models import Attempt, Run, RunState
from logs_app import store
from logs_app.models import LogChunk, LogManifest
from logs_app.retention import logs_prune
from tests.logs.test_api import NOW, logs_url, running_attempt, ship, succeed

BUCKET = "scheduler-logs-test"


def with_log_storage(settings, backend: str, options: dict) -> None:
    """Override STORAGES; Django's setting_changed handler drops the cached backends."""
    settings.STORAGES = {
        **django_settings.STORAGES,
        "scheduler_logs": {"BACKEND": backend, "OPTIONS": options},
    }


def big_chunk_round_trip(api, queued_run) -> LogChunk:
    """Ship a small chunk and one over the inline size, end the attempt, read both back."""
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 3)
    ship(attempt, 1, 3, 200, width=100)  # ~25 KB > inline_max_bytes (16 KB)
    succeed(attempt)
    big = LogChunk.objects.get(attempt=attempt, sequence=1)
    assert big.byte_count > django_settings.SCHEDULER_LOGS["inline_max_bytes"]
    assert big.content == "" and big.storage_name
    assert LogChunk.objects.get(attempt=attempt, sequence=0).storage_name == ""

    body = api.get(logs_url(attempt.run_id)).json()
    assert [line["n"] for line in body["lines"]] == list(range(203))
    assert body["lines"][-1]["text"] == "line 202" + "x" * 100
    assert body["complete"] is True
    Attempt.objects.filter(id=attempt.id).update(finished_at=NOW - dt.timedelta(days=40))
    LogChunk.objects.filter(attempt=attempt).update(created_at=NOW - dt.timedelta(days=40))
    return big


@pytest.mark.django_db
def test_filesystem_storage_in_a_directory_of_its_own(api, queued_run, settings, tmp_path):
    with_log_storage(
        settings, "django.core.files.storage.FileSystemStorage", {"location": str(tmp_path)}
    )
    assert storages["scheduler_logs"].location == str(tmp_path)

    big = big_chunk_round_trip(api, queued_run)
    assert (tmp_path / big.storage_name).is_file()
    assert logs_prune(now=NOW, retention_days=30) == 3
    assert not (tmp_path / big.storage_name).exists()


@pytest.fixture
def s3(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def object_names(client) -> list[str]:
    return [item["Key"] for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])]


@pytest.mark.django_db
def test_s3_storage_through_django_storages(api, queued_run, settings, s3):
    with_log_storage(
        settings,
        "storages.backends.s3.S3Storage",
        {"bucket_name": BUCKET, "region_name": "us-east-1", "location": "run-logs"},
    )

    big = big_chunk_round_trip(api, queued_run)
    assert object_names(s3) == [f"run-logs/{big.storage_name}"]
    assert logs_prune(now=NOW, retention_days=30) == 3
    assert object_names(s3) == []


@pytest.mark.django_db(transaction=True)
def test_a_storage_backend_that_fails_keeps_chunks_inline_and_the_run_succeeds(
    queued_run, settings, s3
):
    from dispatch.worker import run_execute_delivery
    from jobs.models import RunState
    from logs_app.models import LogManifest
    from logs_app.store import chunk_lines

    # A bucket that does not exist: every save raises boto3's ClientError (not an OSError).
    with_log_storage(
        settings,
        "storages.backends.s3.S3Storage",
        {"bucket_name": "no-such-bucket", "region_name": "us-east-1"},
    )
    run = queued_run()

    def handler(ctx):
        for index in range(300):
            print(f"line {index} " + "y" * 100)  # ~35 KB: above the inline size

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED
    chunks = list(LogChunk.objects.filter(run=run).order_by("sequence"))
    assert all(chunk.storage_name == "" for chunk in chunks)
    lines = [line["n"] for chunk in chunks for line in chunk_lines(chunk)]
    assert lines == list(range(300))
    assert LogManifest.objects.get(attempt__run=run).line_count == 300


# --- slow storage: content placed before the chunk's short transaction ---------------


# The shipper places content before it locks the attempt row: a heartbeat never waits for
# a slow storage write.
@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_does_not_wait_for_the_shippers_storage_io(queued_run, monkeypatch):
    run = queued_run()
    real_place = store.chunk_place

    def slow_place(**kwargs):
        time.sleep(4)  # a slow S3 PUT (botocore defaults: 60 s timeouts, retries)
        return real_place(**kwargs)

    monkeypatch.setattr(store, "chunk_place", slow_place)
    took = {}

    def handler(ctx):
        print("x" * 20000)
        time.sleep(1.6)  # the shipper is now inside chunk_ship, in slow_place
        t = time.monotonic()
        ctx.heartbeat()
        took["heartbeat"] = time.monotonic() - t
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    assert took["heartbeat"] < 0.5, (
        f"ctx.heartbeat() blocked {took['heartbeat']:.1f}s on the shipper"
    )


# Slow log storage delays the outcome (the last chunks must be stored with it) but holds no
# row lock meanwhile, and the lease stays renewed, so the reaper does not take the run.
@pytest.mark.django_db(transaction=True)
def test_slow_storage_delays_the_outcome_without_holding_locks(queued_run, monkeypatch):
    from jobs.services import run_cancel_request

    run = queued_run(heartbeat_timeout_seconds=2)
    real_place = store.chunk_place
    placing = threading.Event()

    def slow_place(**kwargs):
        placing.set()
        time.sleep(5)
        return real_place(**kwargs)

    monkeypatch.setattr(store, "chunk_place", slow_place)

    def handler(ctx):
        print("x" * 20000)
        return "ok"

    worker = threading.Thread(
        target=lambda: (
            run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m"),
            connection.close(),
        )
    )
    worker.start()
    assert placing.wait(10)
    time.sleep(2.5)  # past the lease of 2 s: only renewals keep it
    reaped = reaper_run_once(now=db_now(), config=ReaperConfig())
    started = time.monotonic()
    locked = Run.objects.select_for_update(nowait=True).filter(id=run.id)
    with transaction.atomic():
        assert locked.exists()  # no row lock held while the content is placed
    waited = time.monotonic() - started
    worker.join(30)
    assert reaped.lost == 0 and waited < 1
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED
    assert LogManifest.objects.filter(attempt__run=run).exists()
    assert not run_cancel_request(run=Run.objects.get(id=run.id), actor=None, now=db_now())
