"""Capture and shipping in the worker runtime, in-process against the real database."""

import logging
import sys
import time

import pytest
from django.core.files.storage import storages

from dispatch.runtime import run_execute_delivery
from jobs.models import Run, RunState
from logs_app.models import LogChunk, LogManifest
from logs_app.redaction import redact
from logs_app.store import chunk_lines
from tests.factories import PINNED_NOW

NOW = PINNED_NOW


def stored_lines(run) -> list[dict]:
    lines = []
    for chunk in LogChunk.objects.filter(run=run).order_by("attempt__number", "sequence"):
        lines += chunk_lines(chunk)
    return lines


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


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("password=hunter2 next", "password=[REDACTED] next"),
        ('{"api_key": "abc123", "user": "bob"}', '{"api_key": "[REDACTED]", "user": "bob"}'),
        ("Authorization: Bearer eyJhbGci.x.y", "Authorization: [REDACTED]"),
        ("db_token='s3cr3t'", "db_token='[REDACTED]'"),
        ("client_secret: zz; ok", "client_secret: [REDACTED]; ok"),
        ("nothing to hide here", "nothing to hide here"),
        ("args=('a', 'password=hunter2') next", "args=('a', 'password=[REDACTED]') next"),
        ("url?token=abc&x=1", "url?token=[REDACTED]&x=1"),
        ("refreshing the token for bob", "refreshing the token for bob"),
    ],
)
def test_secret_looking_values_are_redacted(line, expected):
    assert redact(line) == expected


@pytest.mark.django_db(transaction=True)
def test_redaction_happens_before_storage(queued_run):
    run = queued_run()

    def handler(ctx):
        ctx.logger.info("connecting with password=%s", "hunter2")

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    (line,) = stored_lines(run)
    assert line["text"] == "connecting with password=[REDACTED]"
    assert "hunter2" not in LogChunk.objects.get(run=run).content
