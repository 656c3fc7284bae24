"""`python manage.py standalone`: the whole system in one command, on any settings.

Starts the embedded PostgreSQL when the settings use it (no DATABASE_URL), migrates, makes
sure an admin user exists, prints it with the URLs and a new API token of a plain user
`api`, then runs the web server, a scheduler, a relay and a Celery worker as child
processes, restarting any that dies, until Ctrl-C or SIGTERM stops them all, and the
embedded PostgreSQL after them.

A SIGKILLed standalone leaves nothing that blocks the next start: on Linux each child gets
SIGTERM when standalone dies (PR_SET_PDEATHSIG), and `var/standalone.pid` names standalone
and its children, so the next start refuses to run beside a live standalone and stops the
children a dead one left (elsewhere than Linux). The embedded PostgreSQL it leaves running
is reused.

The web server is gunicorn (a production WSGI server; Django's runserver opened a thread,
and a database connection, per request, until PostgreSQL refused new ones):
`web_workers()` sync workers, each holding at most one connection (CONN_MAX_AGE keeps it
between requests). docs/connections.md counts the connections of the whole stack.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from dispatch.commands import worker_argv
from jobs.clock import db_now
from jobs.tokens import token_create, tokens_revoke

STOP_GRACE_SECONDS = 20
# The owner of the API token that standalone prints (a plain user, not the admin).
STANDALONE_API_USER = "api"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def web_workers() -> int:
    """Sync workers: two per core (a request spends about half its time waiting on the
    database), at least 2, at most 8 (each is a connection)."""
    return max(2, min(8, 2 * (os.cpu_count() or 1)))


def follow_slots(workers: int | None) -> int:
    """Live tails that may wait at once: all web workers but two (at least one)."""
    return max(1, (workers or web_workers()) - 2)


def web_argv(*, host: str, port: int, workers: int | None) -> list[str]:
    """The gunicorn command line of the web process."""
    argv = [sys.executable, "-m", "gunicorn", "scheduler_project.wsgi:application",
            "--bind", f"{host}:{port}", "--chdir", str(settings.BASE_DIR),
            "--timeout", "60", "--graceful-timeout", "10"]  # fmt: skip
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
            help="gunicorn worker processes (default: 2 per core, 2-8)",
        )

    def handle(self, *args, host, port, worker_concurrency, web_workers, **options):
        # SIGTERM before the children run (while migrating) unwinds through `finally`, so
        # the embedded PostgreSQL is stopped then too.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        pid_file = PidFile(Path(settings.VAR_DIR) / "standalone.pid")
        pid_file.claim()
        _port_free(host, port)
        # The embedded PostgreSQL (no DATABASE_URL): started before the children, stopped
        # after them, whoever started it (a lone `manage.py` or a killed standalone).
        database = getattr(connection, "embedded_server", None)
        try:
            if database is not None:
                self.stdout.write(f"Starting the embedded PostgreSQL in {database.data_dir} ...")
                self.stdout.flush()
                try:
                    database.start()
                except RuntimeError as exc:  # no build for this platform, no user for root
                    raise CommandError(str(exc)) from exc
            self._serve(host, port, worker_concurrency, web_workers, database, pid_file)
        finally:
            connection.close()
            if database is not None:
                database.stop()
            pid_file.release()
        self.stdout.write("stopped")

    def _serve(self, host, port, worker_concurrency, web_workers, database, pid_file) -> None:
        self.stdout.write("Migrating the database ...")
        self.stdout.flush()
        call_command("migrate", interactive=False, verbosity=0)
        username, password, api_username, token = self._first_users()
        base = f"http://{host}:{port}"
        where = (
            f"the embedded PostgreSQL (socket in {database.socket_dir})"
            if database is not None
            else "the configured database"
        ) + (" and the filesystem broker in var/" if settings.EMBEDDED_BROKER else "")
        self.stdout.write(
            "\n".join(
                [
                    f"Scheduler running on {where}",
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
            # Live tails wait in all but two of the sync web workers: the others always
            # answer (logs_app.tails).
            "SCHEDULER_LOG_FOLLOW_MAX_WAITING": os.environ.get(
                "SCHEDULER_LOG_FOLLOW_MAX_WAITING",
                str(follow_slots(web_workers)),
            ),
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
        connection.close()  # the children open their own; this one would idle meanwhile
        Supervisor(commands, env, self.stdout, pid_file).run()

    def _first_users(self) -> tuple[str, str | None, str, str]:
        """(admin username, its password if new, API username, a new API token's key).
        The token is not a superuser's (docs/security.md): it belongs to a plain user
        `api`; each start revokes the token the previous start printed (keys are hashed, so
        an old one cannot be printed again)."""
        users = get_user_model()
        admin = users.objects.filter(is_superuser=True).order_by("id").first()
        password = None
        if admin is None:
            password = secrets.token_urlsafe(12)
            admin = users.objects.create_superuser("admin", "admin@localhost", password)
        api_user, _ = users.objects.get_or_create(username=STANDALONE_API_USER)
        now = db_now()  # the clock tokens expire against
        tokens_revoke(tokens=api_user.api_tokens.filter(name="standalone"), now=now)
        _, key = token_create(owner=api_user, now=now, name="standalone")
        return admin.get_username(), password, api_user.get_username(), key


def _port_free(host: str, port: int) -> None:
    """CommandError when something listens on the web port already (gunicorn would retry
    binding it forever)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CommandError(f"{host}:{port} is taken ({exc.strerror}): stop what listens "
                               "there, or choose another --port") from None  # fmt: skip


def _command_line(pid: int) -> str:
    """A live process's command line ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return subprocess.run(["ps", "-o", "command=", "-p", str(pid)],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip


class PidFile:
    """`var/standalone.pid`: standalone's pid, then a line per child ("pid command line").
    The next start refuses to run beside a live standalone and stops the children that a
    killed one left; a line whose pid now runs another command is ignored (pid reused)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = None  # the descriptor whose lock says "a standalone runs here"

    def _lines(self) -> list[tuple[int, str]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        lines = [line.split(" ", 1) for line in text.splitlines() if line.strip()]
        return [(int(fields[0]), fields[1] if len(fields) > 1 else "") for fields in lines]

    def claim(self) -> None:
        # Held while this process lives, released by the kernel however it dies: two
        # standalones started at the same instant cannot both pass (the children do not
        # inherit it: Popen closes descriptors).
        self.lock = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock)
            raise CommandError(f"standalone already runs here ({self.path})") from None
        lines = self._lines()
        if lines:
            pid, command = lines[0]
            if pid != os.getpid() and "standalone" in _command_line(pid):
                raise CommandError(f"standalone already runs here (pid {pid}, {self.path})")
            left = [pid for pid, command in lines[1:] if command and _command_line(pid) == command]
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            while left and time.monotonic() < deadline:
                left = [pid for pid in left if _command_line(pid)]
                time.sleep(0.2)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.write({})

    def write(self, children: dict[str, subprocess.Popen]) -> None:
        lines = [f"{os.getpid()} {_command_line(os.getpid())}"]
        lines += [f"{child.pid} {' '.join(child.args)}" for child in children.values()]
        aside = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        aside.write_text("\n".join(lines) + "\n")
        aside.replace(self.path)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def _die_with_parent(parent: int):
    """A child's preexec_fn: on Linux the kernel sends it SIGTERM when standalone dies,
    however it dies (SIGKILL included), so no orphan keeps the port or works beside the
    next start's processes."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

    def preexec() -> None:
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # standalone died before the prctl took effect
            os._exit(1)

    return preexec


class Supervisor:
    """Starts the children, restarts any that exits, and stops them all on a signal."""

    def __init__(self, commands: dict[str, list[str]], env: dict, out, pid_file) -> None:
        self.commands, self.env, self.out, self.pid_file = commands, env, out, pid_file
        self.children: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def _start(self, name: str) -> None:
        # Each child's database connections carry its name (pg_stat_activity.application_name).
        env = {**self.env, "SCHEDULER_DB_APPLICATION_NAME": f"scheduler-{name}"}
        self.children[name] = subprocess.Popen(
            self.commands[name], env=env, preexec_fn=_die_with_parent(os.getpid())
        )
        self.pid_file.write(self.children)

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
