"""`python manage.py standalone` on embedded defaults (SQLite, filesystem broker): no
external service at all, the same pipeline end to end, and a clean stop on SIGTERM."""

import datetime as dt
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import requests

from tests.processes import ROOT, wait_for

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_standalone_on_embedded_defaults_runs_a_job_end_to_end(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")
    }
    record = tmp_path / "executions.jsonl"
    env |= {
        "SCHEDULER_VAR_DIR": str(tmp_path / "var"),
        "SCHEDULER_TASK_MODULES": "tests.sample_tasks",
        "SAMPLE_TASK_RECORD": str(record),
        "PYTHONUNBUFFERED": "1",
    }
    port = _free_port()
    log_path = tmp_path / "standalone.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "standalone", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        token = (
            wait_for(
                lambda: re.search(rb"API token: (\w+)", log_path.read_bytes()),
                timeout=60,
                message="the API token to be printed",
            )
            .group(1)
            .decode()
        )
        http = requests.Session()
        http.headers["Authorization"] = f"Token {token}"
        base = f"http://127.0.0.1:{port}/api/v1"
        wait_for(lambda: _answers(http, f"{base}/jobs/"), timeout=60, message="the web server")
        # A production server that the project installs, not Django's development one.
        assert http.get(f"{base}/jobs/").headers["Server"].startswith("gunicorn")
        admin_css = http.get(f"http://127.0.0.1:{port}/static/admin/css/base.css")
        assert admin_css.status_code == 200
        bulk = http.post(
            f"{base}/jobs/bulk/",
            json=[
                {"name": f"bulk {i}", "task": "scheduler.echo", "idempotency_key": f"b{i}",
                 "schedule": {"kind": "cron", "expression": "0 9 * * *"}}
                for i in range(3)
            ],
        )  # fmt: skip
        assert bulk.status_code == 201, bulk.text
        run_at = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)).isoformat()
        created = http.post(
            f"{base}/jobs/",
            json={
                "name": "embedded",
                "task": "tests.record",
                "args": ["embedded"],
                "schedule": {"kind": "once", "run_at": run_at},
            },
        )
        assert created.status_code == 201, created.text

        def succeeded():
            runs = http.get(f"{base}/runs/").json()["results"]
            return runs if runs and runs[0]["state"] == "succeeded" else None

        runs = wait_for(succeeded, timeout=60, message="the run to succeed")
        assert len(runs) == 1 and runs[0]["attempt_count"] == 1
        assert record.read_text().count('"executed"') == 1

        # The README's first curl: the built-in echo task, present on every installation.
        echo = http.post(
            f"{base}/jobs/",
            json={
                "name": "hello",
                "task": "scheduler.echo",
                "args": ["hello"],
                "schedule": {"kind": "once", "run_at": dt.datetime.now(dt.UTC).isoformat()},
            },
        )
        assert echo.status_code == 201, echo.text
        echo_runs = wait_for(
            lambda: [
                r
                for r in http.get(f"{base}/jobs/{echo.json()['id']}/runs/").json()["results"]
                if r["state"] == "succeeded"
            ],
            timeout=60,
            message="the echo run to succeed",
        )
        assert echo_runs[0]["result"] == {"args": ["hello"], "kwargs": {}}
        assert (tmp_path / "var" / "scheduler.sqlite3").exists()
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
    assert returncode == 0, log_path.read_text(errors="replace")[-3000:]
    assert b"stopped" in log_path.read_bytes()


def _answers(http: requests.Session, url: str) -> bool:
    try:
        return http.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False
