"""Integrations switched on by the environment: Sentry (SENTRY_DSN) in web requests and in
the worker, against a fake Sentry endpoint on this machine, and JSON logs
(SCHEDULER_LOG_FORMAT=json). Each runs in a fresh process, as settings are read once."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from jobs.models import Run, RunState
from tests import factories
from tests.processes import wait_for

ROOT = Path(__file__).resolve().parents[2]


class FakeSentry:
    """An HTTP server that takes Sentry envelopes as sentry.io would and keeps their
    events (a DSN of its own: http://key@127.0.0.1:port/1)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        events = self.events

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                for header, payload in zip(lines[1::2], lines[2::2], strict=False):
                    if header.get("type") == "event":
                        events.append(payload)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.dsn = f"http://fakekey@127.0.0.1:{self.server.server_address[1]}/1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sentry():
    fake = FakeSentry()
    yield fake
    fake.close()


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "scheduler_project.settings.base",
            "SCHEDULER_VAR_DIR": str(tmp_path / "var"),
            "CELERY_BROKER_URL": "memory://",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_exception_in_a_web_request_reaches_sentry(sentry, tmp_path):
    probe = """
import django, sentry_sdk
django.setup()
from django.test import Client, override_settings
with override_settings(ROOT_URLCONF="tests.project.sentry_urls", ALLOWED_HOSTS=["testserver"]):
    print(Client(raise_request_exception=False).get("/boom/").status_code)
sentry_sdk.flush(timeout=10)
"""
    done = run_python(probe, tmp_path, SENTRY_DSN=sentry.dsn)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "500"
    wait_for(lambda: sentry.events, timeout=10, message="the event")
    (event,) = sentry.events
    assert event["exception"]["values"][-1]["value"] == "sentry probe: a view raised"
    assert event["transaction"] == "/boom/"  # named by Django's integration, from the route
    assert {"django", "celery"} <= set(event["sdk"]["integrations"])
    # No local variables leave the process (a job's args may hold secrets).
    frames = event["exception"]["values"][-1]["stacktrace"]["frames"]
    assert not any("vars" in frame for frame in frames)


def test_nothing_is_sent_without_a_dsn(sentry, tmp_path):
    probe = """
import django, sentry_sdk
django.setup()
print(sentry_sdk.is_initialized())
"""
    done = run_python(probe, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@pytest.mark.slow
def test_a_failing_handler_in_the_worker_reaches_sentry_with_its_run(stack, sentry):
    stack.scheduler()
    stack.relay()
    stack.worker(SENTRY_DSN=sentry.dsn)
    job = factories.one_time_job(task="tests.fail", retry={"max_attempts": 1})
    run = wait_for(
        lambda: Run.objects.filter(job=job, state=RunState.FAILED).first(),
        timeout=60,
        message="the run to fail",
    )
    wait_for(lambda: sentry.events, timeout=30, message="the event")
    event = sentry.events[0]
    assert event["exception"]["values"][-1]["value"] == "boom"
    assert event["tags"]["task"] == "tests.fail"
    assert event["tags"]["run_id"] == str(run.id)
    assert event["tags"]["attempt"] == "1"
    assert "celery" in event["sdk"]["integrations"]


def test_json_logs_carry_the_records_fields(tmp_path):
    probe = """
import django, logging
django.setup()
logging.getLogger("jobs.task.demo").warning("charging %s", "c-1", extra={"run_id": "r-1"})
"""
    done = run_python(probe, tmp_path, SCHEDULER_LOG_FORMAT="json")
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if "charging" in line]
    record = json.loads(line)
    assert (record["level"], record["logger"], record["message"]) == (
        "WARNING", "jobs.task.demo", "charging c-1"
    )  # fmt: skip
    assert record["run_id"] == "r-1" and record["time"] and record["process"]


def test_an_unknown_log_format_is_refused(tmp_path):
    done = run_python("import django; django.setup()", tmp_path, SCHEDULER_LOG_FORMAT="xml")
    assert done.returncode != 0
    assert "SCHEDULER_LOG_FORMAT must be plain or json, not 'xml'" in done.stderr


@pytest.mark.parametrize(
    "name, value, reason",
    [
        ("SCHEDULER_PARTITIONS", "0", "must be between 1 and 4096, not '0'"),
        ("SCHEDULER_PARTITIONS", "many", "must be an integer, not 'many'"),
        ("SCHEDULER_PARTITION_LEASE_SECONDS", "0.5", "must be between 1.0 and 600.0, not '0.5'"),
    ],
)
def test_a_partition_setting_out_of_range_is_refused_by_name(tmp_path, name, value, reason):
    done = run_python("import django; django.setup()", tmp_path, **{name: value})
    assert done.returncode != 0
    assert f"{name} {reason}" in done.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [("SCHEDULER_QUEUE_HIGH_WATER", "0"), ("SCHEDULER_QUEUE_HIGH_WATER", "lots"),
     ("SCHEDULER_OWNER_MAX_ACTIVE_RUNS", "-2")],
)  # fmt: skip
def test_a_bad_high_water_mark_or_owner_limit_is_refused(tmp_path, name, value):
    done = run_python("import django; django.setup()", tmp_path, **{name: value})
    assert done.returncode != 0
    assert f"{name} must be a whole number of at least 1, not {value!r}" in done.stderr


def test_the_high_water_mark_and_owner_limit_are_read_from_the_environment(tmp_path):
    probe = """
import django; django.setup()
from django.conf import settings
print(settings.SCHEDULER_QUEUE_HIGH_WATER, settings.SCHEDULER_OWNER_MAX_ACTIVE_RUNS)
"""
    assert run_python(probe, tmp_path).stdout.split() == ["10000", "None"]
    done = run_python(probe, tmp_path, SCHEDULER_QUEUE_HIGH_WATER="500",
                      SCHEDULER_OWNER_MAX_ACTIVE_RUNS="4")  # fmt: skip
    assert done.stdout.split() == ["500", "4"]


def test_secrets_never_reach_sentry_or_the_processes_own_log(sentry, tmp_path):
    probe = """
import django, logging, sentry_sdk
django.setup()
logging.getLogger("jobs.task.demo").warning("connecting with password=%s", "canary-l1")
try:
    raise RuntimeError("refused: api_key=canary-e2 for postgres://app:canary-u3@db/x")
except RuntimeError:
    logging.getLogger("jobs.task.demo").exception("token: canary-x4")
sentry_sdk.flush(timeout=10)
"""
    done = run_python(probe, tmp_path, SENTRY_DSN=sentry.dsn)
    assert done.returncode == 0, done.stderr[-2000:]
    wait_for(lambda: sentry.events, timeout=10, message="the event")
    sent = json.dumps(sentry.events)
    logged = done.stderr
    assert "connecting with password=[REDACTED]" in logged
    for canary in ("canary-l1", "canary-e2", "canary-u3", "canary-x4"):
        assert canary not in sent, canary
        assert canary not in logged, canary
