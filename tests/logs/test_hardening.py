"""Run logs under hostile output and slow or failing stores, in-process: each case was a
defect found in review (a log call raising, a regex backtracking for seconds, a slow store
holding a lock the handler needs, a half-pruned log shown complete)."""

from __future__ import annotations

import datetime as dt
import os
import sys
import threading
import time

import pytest
from celery.utils.log import get_task_logger
from django.db import connection, transaction

from dispatch.reaper import ReaperConfig, reaper_run_once
from dispatch.runtime import run_execute_delivery
from jobs.clock import db_now
from jobs.models import Attempt, Run, RunState
from logs_app import capture as capture_mod
from logs_app import store
from logs_app.capture import LogCapture
from logs_app.models import LogChunk, LogManifest
from logs_app.retention import logs_prune
from logs_app.store import chunk_lines
from tests.logs.test_api import NOW, logs_url, running_attempt, ship, succeed


def stored(run):
    out = []
    for c in LogChunk.objects.filter(run=run).order_by("attempt__number", "sequence"):
        out += chunk_lines(c)
    return out


# A lone surrogate (a file name from os.fsdecode) in a log record is stored escaped.
@pytest.mark.django_db(transaction=True)
def test_a_lone_surrogate_in_a_log_record_does_not_fail_the_run(queued_run):
    run = queued_run()
    seen = []

    def handler(ctx):
        name = os.fsdecode(b"report-\xff.csv")  # 'report-\udcff.csv'
        try:
            ctx.logger.info("processing %s", name)
        except BaseException as exc:  # noqa
            seen.append(type(exc).__name__)
            raise
        return "ok"

    out = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert seen == [], f"logging raised into the handler: {seen}; run {run.state} {out}"


# The same in print().
@pytest.mark.django_db(transaction=True)
def test_a_lone_surrogate_in_print_does_not_fail_the_run(queued_run):
    run = queued_run()

    def handler(ctx):
        print("file", os.fsdecode(b"\xfe"))
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, run.state


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


# Retention goes on when the storage refuses a delete with an error that is not OSError.
class DeleteDenied(Exception):
    pass


@pytest.mark.django_db(transaction=True)
def test_prune_survives_a_storage_delete_error(queued_run, monkeypatch):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 300, width=100)  # goes to storage
    succeed(attempt)
    Attempt.objects.filter(id=attempt.id).update(finished_at=NOW - dt.timedelta(days=40))
    LogChunk.objects.filter(attempt=attempt).update(created_at=NOW - dt.timedelta(days=40))
    from django.core.files.storage import storages

    storage = storages["scheduler_logs"]

    def denied(name):
        raise DeleteDenied("AccessDenied (botocore ClientError is not an OSError)")

    monkeypatch.setattr(storage, "delete", denied)
    try:
        pruned = logs_prune(now=NOW, retention_days=30)
    except DeleteDenied as exc:
        pytest.fail(f"logs_prune raised {exc!r}; no row is ever pruned while it does")
    assert pruned >= 1


# A child forked by the handler writes to the worker's log, not to a copy of the capture.
@pytest.mark.django_db(transaction=True)
def test_a_forked_childs_output_goes_to_the_workers_log(queued_run):
    run = queued_run()
    report = {}

    def handler(ctx):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                print("hello from the child")
                sys.stdout.flush()
                cap = capture_mod._captures.get(threading.get_ident())
                os.write(w, b"captured-in-dead-copy" if cap is not None else b"not-captured")
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        report["child"] = os.read(r, 100).decode()
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    texts = [line["text"] for line in stored(run)]
    assert report["child"] == "not-captured", (
        f"child's print went into the parent's capture copy ({report['child']}); stored: {texts}"
    )


# Lines dropped while the store was down are marked where they are missing, not blamed on
# the per-attempt limit.
@pytest.mark.django_db(transaction=True)
def test_lines_dropped_while_the_store_is_down_are_marked_at_the_gap(queued_run, monkeypatch):
    attempt = running_attempt(queued_run)
    down = threading.Event()
    down.set()
    real = store.chunk_ship

    def flaky(**kw):
        if down.is_set():
            raise ConnectionError("log store down")
        return real(**kw)

    monkeypatch.setattr(capture_mod, "chunk_ship", flaky)
    cap = LogCapture(
        attempt, config={"flush_interval_seconds": 0.1, "buffer_max_bytes": 64 * 20}
    ).start()
    try:
        for i in range(50):
            print(f"line {i}")
        down.clear()
        time.sleep(0.5)
        for i in range(50, 55):
            print(f"line {i}")
    finally:
        chunks, dropped = cap.finish()
    with transaction.atomic():
        from jobs.transitions import attempt_succeed

        assert attempt_succeed(attempt=attempt, now=NOW)
        placed = store.logs_prepare(attempt=attempt, chunks=chunks)
        store.logs_seal(attempt=attempt, placed=placed, dropped_lines=dropped, now=NOW)
    lines = []
    for c in LogChunk.objects.filter(attempt=attempt).order_by("sequence"):
        lines += chunk_lines(c)
    texts = [line["text"] for line in lines]
    assert not any("limit of" in text for text in texts), texts[-7:]
    gap = [text for text in texts if "lines dropped here" in text]
    assert len(gap) == 1 and dropped == int(gap[0].split()[0].strip("["))
    # The marker stands where the lines are missing, before the lines written after.
    assert texts.index(gap[0]) < texts.index("line 50")


# The memory bound counts what is really held.
def test_memory_held_is_what_is_accounted(settings):
    import tracemalloc

    class A:
        run_id = 1
        id = 1
        number = 1
        fencing_token = 1

    cap = LogCapture(A(), config={"capture": True})
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    with cap._lock:
        for i in range(20000):
            cap._append("stdout", "INFO", f"l{i}", dt.datetime.now(dt.UTC).isoformat())
    after = tracemalloc.take_snapshot()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    tracemalloc.stop()
    accounted = cap._held
    assert used < 2 * accounted, (
        f"accounted {accounted} bytes, really {used} ({used / accounted:.1f}x)"
    )


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_inside_a_long_effect_does_not_deadlock_with_the_shipper(queued_run):
    run = queued_run()
    events = []

    def handler(ctx):
        with ctx.effect("charge"):
            # The run row is locked FOR UPDATE for the effect. The shipper, ~1 s later, locks
            # the attempt row FOR UPDATE and inserts a LogChunk, whose FK check needs
            # FOR KEY SHARE on the run row: it waits, holding the attempt row.
            ctx.logger.info("charging")
            time.sleep(2.5)  # long effect body (a payment call...)
            t = time.monotonic()
            ok = ctx.heartbeat()  # UPDATE attempt -> waits for the shipper -> cycle
            events.append(("heartbeat", ok, round(time.monotonic() - t, 1)))
        return "ok"

    out = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, (
        out,
        events,
        run.state,
        run.attempts.first().error[-600:],
    )


@pytest.mark.django_db(transaction=True)
def test_the_same_handler_without_capture_succeeds_too(queued_run, settings):
    settings.SCHEDULER_LOGS = {**settings.SCHEDULER_LOGS, "capture": False}
    run = queued_run()

    def handler(ctx):
        with ctx.effect("charge"):
            ctx.logger.info("charging")
            time.sleep(2.5)
            ctx.heartbeat()
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_the_lease_is_kept_while_the_logs_are_finished(queued_run, monkeypatch):
    run = queued_run(heartbeat_timeout_seconds=2)
    real = capture_mod.chunk_ship

    def slow_connect(**kw):
        time.sleep(6)  # a slow connection to the database (pool exhausted, network)
        return real(**kw)

    monkeypatch.setattr(capture_mod, "chunk_ship", slow_connect)

    def reaper():
        time.sleep(4.5)
        try:
            reaper_run_once(now=db_now(), config=ReaperConfig())
        finally:
            connection.close()

    def handler(ctx):
        print("done")
        time.sleep(1.2)  # the shipper is now in chunk_ship
        threading.Thread(target=reaper).start()
        return "ok"

    out = run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, (out, run.state)


@pytest.mark.django_db(transaction=True)
def test_celery_task_logger_records_are_captured(queued_run):
    from scheduler_project.celery import app  # noqa

    app.log.setup_task_loggers()  # what a worker does at start (propagate=False)
    run = queued_run()
    tlog = get_task_logger("myapp.tasks")

    def handler(ctx):
        tlog.warning("from celery's task logger")
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    texts = [line["text"] for c in LogChunk.objects.filter(run=run) for line in chunk_lines(c)]
    assert any("celery's task logger" in t for t in texts), texts


@pytest.mark.django_db(transaction=True)
def test_a_cursor_past_the_end_and_a_missing_attempt(api, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 3)
    succeed(attempt)
    r = api.get(logs_url(attempt.run_id), {"after": 2**31 - 1, "page_size": 5000})
    assert r.status_code == 200, r.content[:300]
    r = api.get(logs_url(attempt.run_id), {"format": "text", "attempt": 9})
    assert r.status_code == 404


@pytest.mark.django_db(transaction=True)
def test_progress_output_without_newlines_stays_fast_and_bounded(queued_run):
    run = queued_run()
    stats = {}

    def handler(ctx):
        t = time.monotonic()
        for i in range(20000):  # a tqdm-style progress bar: '\r' updates, no '\n'
            sys.stderr.write(f"\r{i:6d} |{'#' * 60}| 12.3it/s")
        stats["seconds"] = time.monotonic() - t
        cap = capture_mod._captures[threading.get_ident()]
        stats["partial_bytes"] = sum(len(piece) for piece in cap._partial.get("stderr", []))
        stats["held_accounted"] = cap._held
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    assert stats["partial_bytes"] < 1_000_000 and stats["seconds"] < 1, stats


@pytest.mark.django_db(transaction=True)
def test_printing_a_byte_dump_is_not_quadratic(queued_run):
    run = queued_run()
    took = {}

    def handler(ctx):
        dump = "-".join(f"{b:02X}" for b in os.urandom(5000))  # 15 KB, 'DE-AD-BE-EF-...'
        t = time.monotonic()
        print(dump)
        took["print"] = time.monotonic() - t
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    assert took["print"] < 0.2, took
