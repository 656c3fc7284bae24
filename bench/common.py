"""What every benchmark needs: a fresh PostgreSQL database and RabbitMQ vhost of its own,
the environment its processes run with, and Django set up on it; all dropped afterwards.
Beside it: the product's processes as one `Stack`, job creation, and quantiles."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PG = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
RABBIT = os.environ.get("BENCH_RABBIT", "amqp://guest:guest@127.0.0.1:5672")
# Where runs write their JSON: under var/, which git ignores. The few results the docs cite
# are kept in bench/results/, each named for what it shows.
RESULTS = ROOT / "var" / "bench"


@contextlib.contextmanager
def bench_environment(prefix: str, *, task_modules: str) -> Iterator[tuple[dict, Path]]:
    """(the processes' environment, a work directory); Django is set up on it, migrated."""
    name = f"{prefix}_{os.getpid()}"
    subprocess.run(["psql", f"{PG}/postgres", "-qc", f"CREATE DATABASE {name}"], check=True)
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", name], check=True)
    subprocess.run(
        ["rabbitmqctl", "-q", "set_permissions", "-p", name, "guest", ".*", ".*", ".*"], check=True
    )
    workdir = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    env = {
        **os.environ,
        "DATABASE_URL": f"{PG}/{name}",
        "CELERY_BROKER_URL": f"{RABBIT}/{name}",
        "DJANGO_SETTINGS_MODULE": "scheduler_project.settings.base",
        "SCHEDULER_TASK_MODULES": task_modules,
        "SCHEDULER_VAR_DIR": str(workdir),
        # The throttles still count every request (their cost is measured), but their
        # rates are not the figure.
        "SCHEDULER_THROTTLE_RATES": "user=100000000/min,bulk=100000000/min",
        # W3 gives one owner 200,000 future jobs: the quota (its cost counted all the same)
        # must not be what stops it.
        "SCHEDULER_OWNER_MAX_JOBS": "10000000",
    }
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    try:
        call_command("migrate", verbosity=0)
        yield env, workdir
    finally:
        connection.close()
        subprocess.run(
            ["psql", f"{PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"]
        )
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", name])


# -- figures ------------------------------------------------------------------------------


def print_profile(call, rows: int) -> None:
    """Run `call()` under cProfile, then print its top `rows` functions by own time and by
    cumulative time (cProfile slows Python down: time the call without it for figures)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        call()
    finally:
        profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats("tottime")
    stats.print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    print(out.getvalue())


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (p99 of 100 values is the 99th smallest); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def summary(values: list[float]) -> dict:
    """p50 / p99 / max (seconds) and the count."""
    return {
        "n": len(values),
        "p50": quantile(values, 0.5),
        "p99": quantile(values, 0.99),
        "max": max(values) if values else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing (or b is 0)."""
    return a / b if a is not None and b else None


def cpu_seconds(pids) -> dict[int, float]:
    """user + system CPU seconds of each live process (Linux /proc)."""
    ticks, seconds = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (a prefork worker's pool, gunicorn's workers)."""
    found, todo = [], [pid]
    while todo and len(found) < 1000:
        current = todo.pop()
        found.append(current)
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except OSError:  # exited
            continue
        for task in tasks:
            with contextlib.suppress(OSError):  # a thread that has just exited
                todo.extend(map(int, (task / "children").read_text().split()))
    return found


def _broker_pids() -> list[int]:
    """RabbitMQ's Erlang VM on this machine (shared by every vhost: what it spends in a
    measurement's window is counted as the measurement's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() == "beam.smp":
                    pids.append(int(entry.name))
    return pids


def database_backends(database: str) -> dict[str, list[int]]:
    """The PostgreSQL backends connected to `database`, but this process's own, by their
    application_name (the Stack names each process's connections by its role)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, application_name FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            [database],
        )
        rows = cursor.fetchall()
    found: dict[str, list[int]] = {}
    for pid, application in rows:
        found.setdefault(application or "other", []).append(pid)
    return found


class RoleCpu:
    """CPU seconds spent per role (the processes under each root pid, the database's
    backends, the broker, this process) between `__init__` and `spent()`: the work a
    measurement costs, which the machine's other load disturbs much less than its time. A
    backend or pool process that exits in between takes its seconds with it."""

    def __init__(self, roots: dict[str, list[int]], database: str | None) -> None:
        self.roots, self.database = roots, database
        self.start = self._read()

    def _read(self) -> dict[str, dict[int, float]]:
        pids = {role: [p for root in roots for p in process_tree(root)]
                for role, roots in self.roots.items()}  # fmt: skip
        if self.database:
            for application, backends in database_backends(self.database).items():
                pids[f"database ({application})"] = backends
        pids["broker"] = _broker_pids()
        pids["bench"] = [os.getpid()]
        return {role: cpu_seconds(role_pids) for role, role_pids in pids.items()}

    def spent(self) -> dict[str, float]:
        spent = {}
        for role, after in self._read().items():
            before = self.start.get(role, {})
            spent[role] = round(sum(s - before.get(pid, 0.0) for pid, s in after.items()), 3)
        return spent


# -- the product's processes --------------------------------------------------------------


def _role(name: str) -> str:
    """A process's role from its name in the Stack (scheduler0 -> scheduler)."""
    return name.rstrip("0123456789")


class Stack:
    """Schedulers, relays and Celery workers of the product, each with its own log file in
    the work directory; `stop()` sends SIGTERM and waits (SIGKILL after 60 s)."""

    def __init__(self, args, env: dict, workdir: Path, *, label: str) -> None:
        self.args, self.env, self.workdir, self.label = args, env, workdir, label
        self.processes: list[tuple[str, subprocess.Popen]] = []

    def _start(self, name: str, argv: list[str], **extra_env: str) -> subprocess.Popen:
        log = open(self.workdir / f"{self.label}-{name}.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            argv,
            env={
                **self.env,
                "SCHEDULER_DB_APPLICATION_NAME": _role(name),
                **extra_env,
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        log.close()
        self.processes.append((name, process))
        return process

    def start(self, *, workers: bool = True, schedulers: bool = True, relays: bool = True):
        from dispatch.commands import worker_argv

        manage = [sys.executable, str(ROOT / "manage.py")]
        if schedulers:
            for index in range(self.args.schedulers):
                self._start(
                    f"scheduler{index}",
                    [*manage, "scheduler", *shlex.split(self.args.scheduler_args)],
                )
        if relays:
            for index in range(self.args.relays):
                self._start(f"relay{index}", [*manage, "relay", *shlex.split(self.args.relay_args)])
        if workers:
            for index in range(self.args.workers):
                argv = worker_argv(
                    name=f"{self.label}w{index}",
                    concurrency=self.args.concurrency,
                    queues=["jobs"],
                    loglevel="WARNING",
                    extra=(f"--pool={self.args.pool}", *shlex.split(self.args.worker_args)),
                )
                self._start(f"worker{index}", argv)
        self.wait_started()
        return self

    def start_web(self, workers: int, timeout: float = 60) -> int:
        """The web process as `standalone` runs it (gunicorn, sync workers), on a free port
        of loopback; returns the port once `/healthz` answers."""
        import socket
        import urllib.request

        from dispatch.management.commands.standalone import web_argv

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self._start("web", web_argv(host="127.0.0.1", port=port, workers=workers))
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                    return port
            except OSError:
                if time.monotonic() > deadline:
                    message = f"the web process did not answer: see {self.workdir}"
                    raise SystemExit(message) from None
                time.sleep(0.2)

    def wait_started(self, timeout: float = 120) -> None:
        """Every scheduler and relay has printed its start line (workers: see `warm_up`)."""
        deadline = time.monotonic() + timeout
        for name, process in self.processes:
            word = {"scheduler": b"scheduler started", "relay": b"relay started"}.get(_role(name))
            if word is None:
                continue
            path = self.workdir / f"{self.label}-{name}.log"
            while word not in path.read_bytes():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not start: see {path}")
                time.sleep(0.1)

    def roles(self) -> dict[str, list[int]]:
        """Root pids by role (scheduler, relay, worker, web)."""
        roles: dict[str, list[int]] = {}
        for name, process in self.processes:
            roles.setdefault(_role(name), []).append(process.pid)
        return roles

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                path = self.workdir / f"{self.label}-{name}.log"
                raise SystemExit(f"{name} exited ({process.returncode}): see {path}")

    def stop(self) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                process.terminate()
        for _, process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- jobs ---------------------------------------------------------------------------------


def bench_owner():
    from django.contrib.auth import get_user_model

    return get_user_model().objects.get_or_create(username="bench")[0]


def bench_owners(count: int) -> list:
    """The owners a burst is shared among: `bench` alone, or bench-1 .. bench-N."""
    from django.contrib.auth import get_user_model

    if count <= 1:
        return [bench_owner()]
    users = get_user_model().objects
    return [users.get_or_create(username=f"bench-{i}")[0] for i in range(1, count + 1)]


def validated_spec(body: dict) -> dict:
    from jobs.api.validation import JobSpecSerializer

    spec = JobSpecSerializer(data=body)
    spec.is_valid(raise_exception=True)
    return dict(spec.validated_data)


def bench_task() -> str:
    """The task the workloads schedule: tests.record, or what `python -m bench.run --task`
    chose (such as tests.record_packed, the same no-op declared `pack=20`)."""
    return os.environ.get("BENCH_TASK", "tests.record")


def once_spec(name: str, due: dt.datetime, task: str | None = None) -> dict:
    return validated_spec(
        {
            "name": name,
            "task": task or bench_task(),
            "schedule": {"kind": "once", "run_at": due.isoformat()},
        }
    )


def create_once_jobs(prefix: str, count: int, due: dt.datetime, owners: list | None = None):
    """`count` one-time jobs named "<prefix> <i>", through `jobs.services.job_create`, of
    `owners` in turn (default: `bench`)."""
    from jobs.services import job_create

    owners = owners or [bench_owner()]
    spec = once_spec(prefix, due)
    now = dt.datetime.now(dt.UTC)
    for index in range(count):
        owner = owners[index % len(owners)]
        job_create(owner=owner, spec={**spec, "name": f"{prefix} {index}"}, now=now)


def creation_rate(probe: int = 50) -> float:
    """Jobs per second `job_create` manages here, now (the probe's jobs are deleted)."""
    from jobs.models import Job

    far = dt.datetime.now(dt.UTC) + dt.timedelta(days=365)
    began = time.monotonic()
    create_once_jobs("probe", probe, far)
    rate = probe / max(time.monotonic() - began, 1e-6)
    Job.objects.filter(name__startswith="probe ").delete()
    return rate


def _due_after(lead: float) -> dt.datetime:
    due = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=lead)).replace(microsecond=0)
    return due + dt.timedelta(seconds=1)


def _warn_if_late(count: int, due: dt.datetime) -> None:
    late = (dt.datetime.now(dt.UTC) - due).total_seconds()
    if late > -0.5:
        print(f"  warning: creating {count} jobs ended {late:+.1f}s after their due instant")


def create_due_burst(
    prefix: str, count: int, *, min_lead: float, owners: list | None = None
) -> dt.datetime:
    """`count` one-time jobs all due at one whole second, far enough ahead that creating them
    ends before it (measured); returns that instant."""
    rate = creation_rate()
    # Creation slows as the tables grow (the probe's rate is the first 50 jobs'): room for it.
    due = _due_after(max(min_lead, 3.0 + 2.5 * count / rate))
    create_once_jobs(prefix, count, due, owners)
    _warn_if_late(count, due)
    return due


def _bulk_post(port: int, token: str, bodies: list[dict], size: int) -> list[int]:
    """POST /api/v1/jobs/bulk/ of `bodies`, `size` a request, one after the other: the
    statuses (a client process of its own: one owner's user)."""
    import http.client
    import json

    statuses = []
    for start in range(0, len(bodies), size):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            connection.request("POST", "/api/v1/jobs/bulk/", body=json.dumps(
                bodies[start:start + size]), headers={
                "Authorization": f"Token {token}", "Content-Type": "application/json"})  # fmt: skip
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        finally:
            connection.close()
    return statuses


def _api_bodies(prefix: str, count: int, due: dt.datetime, owners: int) -> list[list[dict]]:
    """Per owner, its bodies of "<prefix> <i>" jobs (job i belongs to owner i mod owners)."""
    body = {"task": bench_task(), "schedule": {"kind": "once", "run_at": due.isoformat()}}
    return [
        [{**body, "name": f"{prefix} {i}"} for i in range(o, count, owners)] for o in range(owners)
    ]


def _api_post_all(port: int, tokens: list[str], bodies: list[list[dict]], size: int) -> float:
    """Every owner's bodies posted by a client process of its own, all at once; seconds."""
    import multiprocessing

    began = time.monotonic()
    with multiprocessing.get_context("fork").Pool(len(tokens)) as pool:
        posts = [(port, token, own, size) for token, own in zip(tokens, bodies, strict=True)]
        answers = pool.starmap(_bulk_post, posts)
    refused = [status for statuses in answers for status in statuses if status != 201]
    if refused:
        raise SystemExit(f"POST /api/v1/jobs/bulk/ answered {sorted(set(refused))}")
    return time.monotonic() - began


def create_due_burst_api(
    prefix: str, count: int, *, owners: list, port: int, bulk_size: int, min_lead: float
) -> dt.datetime:
    """`count` one-time jobs of `owners` due at one whole second, created through the API
    (`_api_post_all`) far enough ahead that the posts end before it: the lead comes from
    a probe of the same shape (a year ahead, deleted)."""
    from jobs.models import Job
    from jobs.tokens import token_create

    now = dt.datetime.now(dt.UTC)
    tokens = [token_create(owner=owner, now=now, name="bench")[1] for owner in owners]
    probe = max(len(owners) * 25, min(count // 10, 1000))
    far = now + dt.timedelta(days=365)
    rate = probe / _api_post_all(port, tokens, _api_bodies("probe", probe, far, len(owners)),
                                 bulk_size)  # fmt: skip
    Job.objects.filter(name__startswith="probe ").delete()
    due = _due_after(max(min_lead, 3.0 + 2.0 * count / rate))
    _api_post_all(port, tokens, _api_bodies(prefix, count, due, len(owners)), bulk_size)
    _warn_if_late(count, due)
    return due


def warm_up(stack: Stack, *, count: int, timeout: float = 180) -> None:
    """Runs `count` jobs due now and waits until they succeed: every process has booted,
    connected and consumed before a measurement starts."""
    from jobs.models import Run, RunState

    create_once_jobs("warmup", count, dt.datetime.now(dt.UTC))
    deadline = time.monotonic() + timeout
    while (
        Run.objects.filter(job__name__startswith="warmup ", state=RunState.SUCCEEDED).count()
        < count
    ):
        stack.check_alive()
        if time.monotonic() > deadline:
            raise SystemExit(f"warm-up runs did not succeed in {timeout}s: see {stack.workdir}")
        time.sleep(0.2)


def reset_database() -> None:
    """Empty every table of the product (users stay): between measurements of one run."""
    from django.apps import apps
    from django.db import connection

    tables = [
        model._meta.db_table
        for label in ("jobs", "dispatch", "logs_app")
        for model in apps.get_app_config(label).get_models()
    ]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(tables)} CASCADE")


def purge_queue(broker_url: str, queue: str = "jobs") -> None:
    from kombu import Connection

    with Connection(broker_url) as conn:
        try:
            conn.default_channel.queue_purge(queue)
        except Exception:  # noqa: BLE001 - the queue may not exist yet
            pass


def queue_depth(broker_url: str, queue: str = "jobs") -> int | None:
    from kombu import Connection

    with Connection(broker_url) as conn:
        try:
            return conn.default_channel.queue_declare(queue=queue, passive=True).message_count
        except Exception:  # noqa: BLE001
            return None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def results_path(started: dt.datetime, suffix: str = "") -> Path:
    """var/bench/<UTC timestamp><suffix>.json: the default file a run writes."""
    return RESULTS / f"{started:%Y%m%dT%H%M%SZ}{suffix}.json"


def results_header(args, started: dt.datetime) -> dict:
    """What every results JSON starts with: when, which commit, the machine (shared: its
    load says how much the figures can be trusted), and the options."""
    import platform

    return {
        "started": started.isoformat(),
        "commit": git_commit(),
        "host": {
            "node": platform.node(),
            "cpus": os.cpu_count(),
            "python": sys.version,
            "load_average_before": os.getloadavg(),
        },
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
