"""`python manage.py standalone`: the whole system in one command, on any settings.

Migrates, makes sure an admin user exists, prints it with the URLs and a new API token of a
plain user `api`, then runs the web server, a scheduler, a relay and a Celery worker as child
processes, restarting any that dies, until Ctrl-C or SIGTERM stops them all.

The web server is gunicorn (a production WSGI server; Django's runserver opened a thread,
and a database connection, per request, until PostgreSQL refused new ones): on PostgreSQL
`web_workers()` sync workers, each holding at most one connection (CONN_MAX_AGE keeps it
between requests); on SQLite one worker with threads, since writers serialize on the file
anyway. docs/connections.md counts the connections of the whole stack.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.utils import timezone

from dispatch.commands import worker_argv
from jobs.tokens import token_create, tokens_revoke

STOP_GRACE_SECONDS = 20
# The owner of the API token that standalone prints (a plain user, not the admin).
STANDALONE_API_USER = "api"
SQLITE_WEB_THREADS = 4


def web_workers() -> int:
    """Sync workers for PostgreSQL: two per core (a request spends about half its time
    waiting on the database), at least 2, at most 8 (each is a connection)."""
    return max(2, min(8, 2 * (os.cpu_count() or 1)))


def web_argv(*, host: str, port: int, workers: int | None) -> list[str]:
    """The gunicorn command line of the web process."""
    argv = [sys.executable, "-m", "gunicorn", "scheduler_project.wsgi:application",
            "--bind", f"{host}:{port}", "--chdir", str(settings.BASE_DIR),
            "--timeout", "60", "--graceful-timeout", "10"]  # fmt: skip
    if settings.DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
        return [*argv, "--workers", str(workers or 1), "--worker-class", "gthread",
                "--threads", str(SQLITE_WEB_THREADS)]  # fmt: skip
    return [*argv, "--workers", str(workers or web_workers()), "--worker-class", "sync"]


class Command(BaseCommand):
    help = "Run web, scheduler, relay and worker together (embedded defaults need no service)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--worker-concurrency", type=int, default=2)
        parser.add_argument(
            "--web-workers",
            type=int,
            default=None,
            help="gunicorn worker processes (default: 2 per core, 2-8, on PostgreSQL; 1 with "
            f"{SQLITE_WEB_THREADS} threads on SQLite)",
        )

    def handle(self, *args, host, port, worker_concurrency, web_workers, **options):
        self.stdout.write("Migrating the database ...")
        self.stdout.flush()
        call_command("migrate", interactive=False, verbosity=0)
        username, password, api_username, token = self._first_users()
        base = f"http://{host}:{port}"
        self.stdout.write(
            "\n".join(
                [
                    "Scheduler running on "
                    + (
                        "embedded defaults (SQLite, filesystem broker)"
                        if settings.EMBEDDED_BROKER
                        else "the configured database and broker"
                    ),
                    f"  API:       {base}/api/v1/jobs/",
                    f"  API docs:  {base}/api/docs/  (schema: {base}/api/schema/)",
                    f"  Admin:     {base}/admin/",
                    f"  Dashboard: {base}/dashboard/",
                    f"  Metrics:   {base}/metrics  (health: {base}/healthz, {base}/readyz)",
                    f"  Admin user: {username}" + (f"  password: {password}" if password else ""),
                    f"  API user:  {api_username} (no superuser: sees its own jobs)",
                    f"  API token: {token}",
                    f"  Try:       curl -H 'Authorization: Token {token}' {base}/api/v1/jobs/",
                    "Ctrl-C stops everything.",
                ]
            )
        )
        self.stdout.flush()
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ["DJANGO_SETTINGS_MODULE"],
            # The admin's CSS and scripts, from the apps' static folders (no collectstatic).
            "SCHEDULER_SERVE_STATIC": "1",
        }
        django = [sys.executable, "-m", "django"]
        commands = {
            "web": web_argv(host=host, port=port, workers=web_workers),
            "scheduler": [*django, "scheduler"],
            "relay": [*django, "relay"],
            "worker": worker_argv(
                name="standalone",
                concurrency=worker_concurrency,
                queues=[settings.SCHEDULER_DEFAULT_QUEUE],
            ),
        }
        Supervisor(commands, env, self.stdout).run()

    def _first_users(self) -> tuple[str, str | None, str, str]:
        """(admin username, its password if new, API username, a new API token's key).
        The token is not a superuser's (SPEC, "Security"): it belongs to a plain user
        `api`; each start revokes the token the previous start printed (keys are hashed, so
        an old one cannot be printed again)."""
        users = get_user_model()
        admin = users.objects.filter(is_superuser=True).order_by("id").first()
        password = None
        if admin is None:
            password = secrets.token_urlsafe(12)
            admin = users.objects.create_superuser("admin", "admin@localhost", password)
        api_user, _ = users.objects.get_or_create(username=STANDALONE_API_USER)
        now = timezone.now()
        tokens_revoke(tokens=api_user.api_tokens.filter(name="standalone"), now=now)
        _, key = token_create(owner=api_user, now=now, name="standalone")
        return admin.get_username(), password, api_user.get_username(), key


class Supervisor:
    """Starts the children, restarts any that exits, and stops them all on a signal."""

    def __init__(self, commands: dict[str, list[str]], env: dict, out) -> None:
        self.commands, self.env, self.out = commands, env, out
        self.children: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def _start(self, name: str) -> None:
        # Each child's database connections carry its name (pg_stat_activity.application_name).
        env = {**self.env, "SCHEDULER_DB_APPLICATION_NAME": f"scheduler-{name}"}
        self.children[name] = subprocess.Popen(self.commands[name], env=env)

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for name in self.commands:
            self._start(name)
        restarts: dict[str, float] = {}
        while not self.stopping:
            time.sleep(0.5)
            for name, child in list(self.children.items()):
                if child.poll() is not None and not self.stopping:
                    # Back off a process that keeps dying, so a broken setup is readable.
                    if time.monotonic() - restarts.get(name, 0) < 5:
                        time.sleep(2)
                    self.out.write(f"{name} exited with {child.returncode}; restarting")
                    restarts[name] = time.monotonic()
                    self._start(name)
        self.stop()

    def stop(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for child in self.children.values():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.out.write("stopped")
