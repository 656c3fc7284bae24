"""Redaction of secret-looking values in run logs (jobs.redaction, tested on its own in
tests/jobs/test_redaction.py): before a log line is stored, and bounded on a line it cannot
match (a byte dump)."""

import os
import time

import pytest

from dispatch.worker import run_execute_delivery
from logs_app.models import LogChunk
from tests.factories import stored_lines


@pytest.mark.django_db(transaction=True)
def test_redaction_happens_before_storage(queued_run):
    run = queued_run()

    def handler(ctx):
        ctx.logger.info("connecting with password=%s", "hunter2")

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    (line,) = stored_lines(run)
    assert line["text"] == "connecting with password=[REDACTED]"
    assert "hunter2" not in LogChunk.objects.get(run=run).content


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
