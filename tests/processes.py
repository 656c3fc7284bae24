"""Real scheduler, relay and Celery worker processes for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from django.conf import settings
from django.db import connection
from kombu import Connection

from dispatch.commands import worker_argv

ROOT = Path(__file__).resolve().parent.parent


def test_database_url() -> str:
    """The URL of the database the tests run on (pytest-django renamed it)."""
    db = connection.settings_dict
    user = db.get("USER") or ""
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    # Several hosts (libpq's lists, settings.database_url) go back into the netloc as pairs.
    hosts = str(db.get("HOST") or "127.0.0.1").split(",")
    ports = str(db.get("PORT") or 5432).split(",")
    netloc = ",".join(
        f"{quote(host, safe='')}:{port}"  # a Unix socket's folder: %2F...
        for host, port in zip(hosts, ports * len(hosts) if len(ports) == 1 else ports, strict=True)
    )
    options = db.get("OPTIONS", {}).get("target_session_attrs")
    query = f"?target_session_attrs={options}" if options else ""
    return f"postgres://{auth}{netloc}/{db['NAME']}{query}"


def purge_queue(name: str = "jobs") -> None:
    with Connection(settings.CELERY_BROKER_URL) as broker:
        channel = broker.channel()
        try:
            channel.queue_purge(name)
        except Exception:  # noqa: BLE001 - the queue does not exist yet
            pass


def queue_ready_messages(name: str) -> int:
    """The broker's count of the queue's ready messages (0 for a queue not declared yet)."""
    with Connection(settings.CELERY_BROKER_URL) as broker:
        channel = broker.channel()
        try:
            return channel.queue_declare(name, passive=True).message_count
        except Exception:  # noqa: BLE001 - the queue does not exist yet
            return 0


def wait_for(
    condition: Callable[[], object],
    *,
    timeout: float,
    interval: float = 0.2,
    message: str = "condition",
) -> object:
    """Poll `condition` until it returns a true value; bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


class Stack:
    """Starts project processes against the test database and broker; stops them all."""

    def __init__(self, workdir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.record = workdir / "executions.jsonl"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "scheduler_project.settings.base",
            "DATABASE_URL": test_database_url(),
            "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
            "SCHEDULER_TASK_MODULES": "tests.sample_tasks,tests.fault_tasks",
            "SAMPLE_TASK_RECORD": str(self.record),
            "SCHEDULER_VAR_DIR": str(workdir / "var"),
            # The test process reads the logs the workers store: one place for both.
            "SCHEDULER_LOG_STORAGE_OPTIONS": json.dumps(
                settings.STORAGES["scheduler_logs"]["OPTIONS"]
            ),
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        self.processes: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        # Its own session: a signal to the process group reaches a worker's pool children too.
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes[name] = process
        self.commands[name] = (argv, env or {})
        return process

    def signal_group(self, name: str, sig: int) -> None:
        """Send `sig` to the process and its children (a worker's pool processes)."""
        process = self.processes[name]
        if process.poll() is None:
            os.killpg(process.pid, sig)

    def kill(self, name: str) -> None:
        """SIGKILL the process and its children, as an OOM killer or a lost host would."""
        self.signal_group(name, signal.SIGKILL)
        self.processes[name].wait(timeout=30)

    def restart(self, name: str) -> subprocess.Popen:
        """Start a process again with the command line it was first started with."""
        argv, env = self.commands[name]
        return self.start(name, argv, env)

    def scheduler(self, name: str = "scheduler", *args: str, **env: str) -> subprocess.Popen:
        return self.start(
            name, [sys.executable, "manage.py", "scheduler", "--poll-interval", "0.5", *args], env
        )

    def relay(self, name: str = "relay", *args: str, **env: str) -> subprocess.Popen:
        return self.start(name, [sys.executable, "manage.py", "relay", *args], env)

    def worker(self, name: str = "worker", concurrency: int = 2, **env: str) -> subprocess.Popen:
        argv = worker_argv(name=name, concurrency=concurrency, queues=["jobs"])
        process = self.start(name, argv, env)
        wait_for(
            lambda: b" ready." in self.log(name) or process.poll() is not None,
            timeout=60,
            message=f"worker {name} to be ready",
        )
        assert process.poll() is None, self.log(name).decode(errors="replace")[-3000:]
        return process

    def log(self, name: str) -> bytes:
        path = self.workdir / f"{name}.log"
        return path.read_bytes() if path.exists() else b""

    def executions(self) -> list[dict]:

        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line]

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(name, signal.SIGKILL)
                process.wait()
        # A stopped (SIGSTOP) or orphaned child must not outlive the test.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return process.returncode

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)
