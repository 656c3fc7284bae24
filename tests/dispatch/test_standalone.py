"""`python manage.py standalone` on embedded defaults (the embedded PostgreSQL, the filesystem
broker): no external service at all, the same pipeline end to end, a clean stop on SIGTERM
(the database server included), and nothing left by a SIGKILL that blocks the next start."""

import contextlib
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


def _embedded_env(tmp_path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")
    }
    return env | {
        "SCHEDULER_VAR_DIR": str(tmp_path / "var"),
        "SCHEDULER_TASK_MODULES": "tests.sample_tasks",
        "SAMPLE_TASK_RECORD": str(tmp_path / "executions.jsonl"),
        "PYTHONUNBUFFERED": "1",
    }


def _standalone(env: dict, port: int, log_path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "manage.py", "standalone", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def test_standalone_on_embedded_defaults_runs_a_job_end_to_end(tmp_path):
    env = _embedded_env(tmp_path)
    record = tmp_path / "executions.jsonl"
    port = _free_port()
    log_path = tmp_path / "standalone.log"
    process = _standalone(env, port, log_path)
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
        assert (tmp_path / "var" / "postgres" / "PG_VERSION").exists()
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
    assert returncode == 0, log_path.read_text(errors="replace")[-3000:]
    assert b"stopped" in log_path.read_bytes()
    # The database server stopped with the rest.
    assert not (tmp_path / "var" / "postgres" / "postmaster.pid").exists()
    assert not (tmp_path / "var" / "standalone.pid").exists()


def test_a_killed_standalone_leaves_nothing_that_blocks_the_next_start(tmp_path):
    """SIGKILL: the children follow their parent (PR_SET_PDEATHSIG), the port is free again,
    the database server is reused; a second standalone beside a live one is refused."""
    env = _embedded_env(tmp_path)
    port = _free_port()
    log_path = tmp_path / "standalone.log"
    first = _standalone(env, port, log_path)
    try:
        wait_for(lambda: log_path.read_bytes().count(b"API token") == 1, timeout=60,
                 message="the first start's token")  # fmt: skip
        pid_file = tmp_path / "var" / "standalone.pid"
        # Standalone's line, then one per child once all four started.
        lines = wait_for(lambda: (lines := pid_file.read_text().splitlines())[4:] and lines,
                         timeout=60, message="the four children in the pid file")  # fmt: skip
        children = [int(line.split()[0]) for line in lines[1:]]
        assert len(children) == 4
        beside = subprocess.run(
            [sys.executable, "manage.py", "standalone", "--port", str(_free_port())],
            cwd=ROOT, env=env, capture_output=True, timeout=120,
        )  # fmt: skip
        assert beside.returncode != 0 and b"standalone already runs" in beside.stderr
    finally:
        first.kill()
        first.wait()
    wait_for(lambda: not any(_alive(pid) for pid in children), timeout=60,
             message="the killed standalone's children to stop")  # fmt: skip
    second = _standalone(env, port, log_path)
    try:
        token = wait_for(
            lambda: re.findall(rb"API token: (\w+)", log_path.read_bytes())[1:],
            timeout=60, message="the second start's token",
        )[0].decode()  # fmt: skip
        http = requests.Session()
        http.headers["Authorization"] = f"Token {token}"
        base = f"http://127.0.0.1:{port}/api/v1"
        wait_for(lambda: _answers(http, f"{base}/jobs/"), timeout=60, message="the web server")
    finally:
        second.send_signal(signal.SIGTERM)
        returncode = second.wait(timeout=60)
    assert returncode == 0, log_path.read_text(errors="replace")[-3000:]
    assert not (tmp_path / "var" / "postgres" / "postmaster.pid").exists()


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _answers(http: requests.Session, url: str) -> bool:
    try:
        return http.get(url, timeout=2).status_code == 200
    except (requests.ConnectionError, requests.Timeout):  # not up yet, or a loaded machine
        return False


def test_standalone_on_postgresql_serves_eight_concurrent_clients_without_a_500(
    transactional_db, tmp_path
):
    """runserver opened a connection per request thread until PostgreSQL refused more; the
    gunicorn workers hold one each, so the count stays bounded however many requests."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    from dispatch.management.commands.standalone import web_workers
    from tests.processes import purge_queue, test_database_url

    purge_queue()
    env = {**os.environ, "DATABASE_URL": test_database_url(), "PYTHONUNBUFFERED": "1",
           "SCHEDULER_VAR_DIR": str(tmp_path / "var"),
           "DJANGO_SETTINGS_MODULE": "scheduler_project.settings.base"}  # fmt: skip
    port = _free_port()
    log_path = tmp_path / "standalone.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "standalone", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    database = connection.settings_dict["NAME"]

    def connections_open() -> dict[str, int]:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s "
                "AND pid <> pg_backend_pid() GROUP BY 1",
                [database],
            )
            return dict(cursor.fetchall())

    try:
        token = wait_for(
            lambda: re.search(rb"API token: (\w+)", log_path.read_bytes()),
            timeout=60, message="the API token to be printed",
        ).group(1).decode()  # fmt: skip
        base = f"http://127.0.0.1:{port}/api/v1"
        headers = {"Authorization": f"Token {token}"}
        wait_for(lambda: _up(base, headers), timeout=60, message="the web server")
        most = [connections_open()]

        def client(index: int) -> list[int]:
            statuses = []
            with requests.Session() as http, contextlib.closing(connection):
                http.headers.update(headers)
                for n in range(40):
                    body = {"name": f"c{index}-{n}", "task": "scheduler.echo",
                            "schedule": {"kind": "cron", "expression": "0 9 * * *"}}  # fmt: skip
                    statuses.append(http.post(f"{base}/jobs/", json=body, timeout=60).status_code)
                    if n % 10 == 0:
                        statuses.append(http.get(f"{base}/jobs/", timeout=60).status_code)
                    if index == 0:
                        most.append(connections_open())
            return statuses

        with ThreadPoolExecutor(8) as pool:
            statuses = [s for result in pool.map(client, range(8)) for s in result]
        assert set(statuses) <= {200, 201}, sorted(set(statuses))
        assert statuses.count(201) == 8 * 40
        # One connection per gunicorn worker at most, whatever the number of requests.
        web = max(seen.get("scheduler-web", 0) for seen in most)
        assert 1 <= web <= web_workers(), most
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
    assert returncode == 0, log_path.read_text(errors="replace")[-3000:]
    # Stopped, the stack leaves no connection behind.
    wait_for(lambda: not connections_open(), timeout=30, message="the connections to close")


def _up(base: str, headers: dict) -> bool:
    try:
        return requests.get(f"{base}/jobs/", headers=headers, timeout=10).status_code == 200
    except requests.RequestException:  # not listening yet, or still starting
        return False


def test_two_standalones_started_at_once_cannot_both_claim_var(tmp_path):
    """The claim is a lock the kernel holds for the process's life, not only a pid file
    read then written: a second claim meanwhile is refused, even from the same instant."""
    from django.core.management.base import CommandError

    from dispatch.management.commands.standalone import PidFile

    first, second = PidFile(tmp_path / "standalone.pid"), PidFile(tmp_path / "standalone.pid")
    first.claim()
    try:
        with pytest.raises(CommandError, match="already runs here"):
            second.claim()
    finally:
        first.release()
    second.claim()  # released: the next start goes ahead
    second.release()
