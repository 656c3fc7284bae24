"""Capture and shipping in the worker runtime, in-process against the real database; and
capture under hostile output (lone surrogates, forked children, Celery's task loggers,
progress bars without newlines, a store that is down, memory counted as held)."""

import datetime as dt
import logging
import os
import sys
import threading
import time

import pytest
from celery.utils.log import get_task_logger
from django.core.files.storage import storages
from django.db import transaction

from dispatch.worker import run_execute_delivery
from jobs.models import Run, RunState
from logs_app import capture as capture_mod
from logs_app import store
from logs_app.capture import LogCapture
from logs_app.models import LogChunk, LogManifest
from logs_app.store import chunk_lines
from tests.factories import PINNED_NOW, running_attempt, stored_lines

NOW = PINNED_NOW


@pytest.mark.django_db(transaction=True)
def test_every_stream_is_captured_in_order_with_stream_and_level(queued_run):
    run = queued_run()

    def handler(ctx):
        ctx.logger.info("from ctx.logger %s", 1)
        print("to stdout")
        print("to stderr", file=sys.stderr)
        logging.getLogger("some.library").warning("library warning")
        ctx.logger.debug("debug is kept too")
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    lines = stored_lines(run)
    assert [(line["stream"], line["level"], line["text"]) for line in lines] == [
        ("logger", "INFO", "from ctx.logger 1"),
        ("stdout", "INFO", "to stdout"),
        ("stderr", "ERROR", "to stderr"),
        ("logging", "WARNING", "some.library: library warning"),
        ("logger", "DEBUG", "debug is kept too"),
    ]
    assert [line["n"] for line in lines] == [0, 1, 2, 3, 4]
    manifest = LogManifest.objects.get(attempt__run=run)
    assert (manifest.line_count, manifest.chunk_count, manifest.dropped_lines) == (5, 1, 0)
    # Output of other threads (not the handler's) is not captured.
    print("after the handler")
    assert len(stored_lines(run)) == 5


@pytest.mark.django_db(transaction=True)
def test_lines_ship_while_the_handler_runs_and_big_chunks_go_to_storage(queued_run):
    run = queued_run()
    seen_during_run = []

    def handler(ctx):
        for index in range(3000):
            print(f"line {index} " + "x" * 100)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not LogChunk.objects.filter(run_id=ctx.run_id):
            time.sleep(0.05)
        seen_during_run.append(LogChunk.objects.filter(run_id=ctx.run_id).count())
        print("last line")

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    assert seen_during_run[0] >= 1  # shipped before the handler returned
    lines = stored_lines(run)
    assert [line["n"] for line in lines] == list(range(3001))
    assert lines[-1]["text"] == "last line"
    stored = LogChunk.objects.filter(run=run).exclude(storage_name="")
    assert stored.exists()  # chunks above the inline size live in the storage backend
    assert storages["scheduler_logs"].exists(stored.first().storage_name)
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_the_per_attempt_limit_truncates_with_a_marker(queued_run, settings):
    settings.SCHEDULER_LOGS = {**settings.SCHEDULER_LOGS, "max_bytes_per_attempt": 2000}
    run = queued_run()

    def handler(ctx):
        for index in range(100):
            print(f"line {index}")

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    lines = stored_lines(run)
    assert lines[-1]["stream"] == "system"
    assert "truncated" in lines[-1]["text"]
    manifest = LogManifest.objects.get(attempt__run=run)
    assert manifest.dropped_lines == 100 - (len(lines) - 1)
    assert manifest.dropped_lines > 0


# --- hostile output ---------------------------------------------------------------------


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
    texts = [line["text"] for line in stored_lines(run)]
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


def test_a_run_that_prints_nothing_starts_no_shipper_and_still_seals_its_log(queued_run):
    run = queued_run()
    shippers_before = {t.ident for t in threading.enumerate() if t.name == "log-shipper"}
    seen = []

    def quiet(ctx):
        seen.append({t.ident for t in threading.enumerate() if t.name == "log-shipper"})
        return "ok"

    run_execute_delivery(run_id=str(run.id), handler=quiet, worker="w", message_id="m")

    assert seen == [shippers_before]  # nothing printed: no thread for it
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED
    manifest = LogManifest.objects.get(attempt__run=run)
    assert (manifest.chunk_count, manifest.line_count) == (0, 0)
