"""API benchmark: job creation through the web server that `standalone` runs (gunicorn).

    .venv/bin/python -m bench.api --clients 8 --seconds 15 --bulk-requests 20

Creates a fresh PostgreSQL database (dropped afterwards), starts gunicorn on it as
`standalone` does (sync workers; --web-workers, default 2 per core), then measures:

- `POST /api/v1/jobs/` from --clients client processes for --seconds, each request with
  its own Idempotency-Key (--no-keys: none), one user and token per client (the per-user
  throttle would otherwise be the figure);
- `POST /api/v1/jobs/bulk/` of --bulk-size bodies, --bulk-requests in all from
  --bulk-clients processes, each item with an idempotency_key unless --no-keys.

- the floor: `GET /healthz` (no database, no DRF: Django's middleware and gunicorn only)
  from the same --clients processes for as long, in the same run: what the web tier and
  these clients can answer at all on this machine, whatever a view does;
- the DRF floor: `POST /api/v1/schedules/preview/` of the same schedule, as long: token
  authentication, the shared throttle, DRF's parsing, validation (croniter) and rendering,
  and nothing written. A creation does all of that and then writes its rows.

Prints jobs/s created, the CPU time the web workers and the database's backends spent per
job (less disturbed by the machine's other load than jobs/s: on an idle box, jobs/s is
about cores / the CPU per job, the clients' included), every answer that was not 201 (a
500 would be a bug), and the most database connections open at once (pg_stat_activity),
which the web tier must keep bounded (docs/connections.md). --json writes the figures too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from bench.common import ROOT, RoleCpu, bench_environment

BODY = {
    "task": "tests.record",
    "schedule": {"kind": "cron", "expression": "0 9 * * MON-FRI", "timezone": "Europe/Berlin"},
    "misfire": {"policy": "run_latest", "grace_seconds": 300},
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _request(port: int, method: str, path: str, *, body=None, headers: dict | None = None) -> int:
    """One request on a new connection: its status, 0 when refused or reset."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers=headers or {})  # fmt: skip
        response = connection.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0  # refused or reset: counted as a failure
    finally:
        connection.close()


def _post(port: int, token: str, path: str, body, headers: dict | None = None) -> int:
    return _request(port, "POST", path, body=body, headers={
        "Authorization": f"Token {token}", "Content-Type": "application/json", **(headers or {})
    })  # fmt: skip


# The DRF floor's request: authenticated, throttled, parsed and validated as a creation
# is (the schedule through croniter), answered from memory: nothing written.
PREVIEW = {"schedule": BODY["schedule"], "after": "2030-01-01T00:00:00Z", "count": 1}


def _floor_client(port: int, seconds: float, start_at: float, token: str | None) -> Counter:
    """GET /healthz (no token) or POST /schedules/preview/ one after the other until the
    time is up: Counter of statuses."""
    while time.time() < start_at:
        time.sleep(0.001)
    statuses, deadline = Counter(), start_at + seconds
    while time.time() < deadline:
        if token is None:
            statuses[_request(port, "GET", "/healthz")] += 1
        else:
            statuses[_post(port, token, "/api/v1/schedules/preview/", PREVIEW)] += 1
    return statuses


def _single_client(port: int, token: str, seconds: float, keys: bool, start_at: float):
    """POST /jobs/ one after the other until the time is up: Counter of statuses."""
    while time.time() < start_at:
        time.sleep(0.001)
    statuses, prefix, index = Counter(), uuid.uuid4().hex[:8], 0
    deadline = start_at + seconds
    while time.time() < deadline:
        index += 1
        headers = {"Idempotency-Key": f"{prefix}-{index}"} if keys else {}
        statuses[_post(port, token, "/api/v1/jobs/", {**BODY, "name": f"s{index}"}, headers)] += 1
    return statuses


def _bulk_client(port: int, token: str, requests: int, size: int, keys: bool):
    statuses, prefix = Counter(), uuid.uuid4().hex[:8]
    for request in range(requests):
        items = [
            {**BODY, "name": f"b{request}-{i}",
             **({"idempotency_key": f"{prefix}-{request}-{i}"} if keys else {})}
            for i in range(size)
        ]  # fmt: skip
        statuses[_post(port, token, "/api/v1/jobs/bulk/", items)] += 1
    return statuses


class CpuMeter:
    """CPU seconds spent by the web workers and by the database's backends for this
    database: a figure the machine's other load disturbs much less than jobs/s
    (bench.common.RoleCpu, its roles summed into these two)."""

    def __init__(self, server_pid: int, database: str) -> None:
        self.roles = RoleCpu({"web": [server_pid]}, database)

    def spent(self) -> tuple[float, float]:
        """(web, database) CPU seconds since the meter started."""
        spent = self.roles.spent()
        database = sum(v for role, v in spent.items() if role.startswith("database ("))
        return spent["web"], database


class ConnectionWatch(threading.Thread):
    """The most connections to the benchmark's database seen at once, sampled every 50 ms."""

    def __init__(self, database: str) -> None:
        super().__init__(daemon=True)
        self.database, self.most, self.stopping = database, 0, threading.Event()

    def run(self) -> None:
        from django.db import connections

        with connections["default"].cursor() as cursor:
            while not self.stopping.is_set():
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [self.database]
                )
                self.most = max(self.most, cursor.fetchone()[0] - 1)  # less this one
                time.sleep(0.05)
        connections["default"].close()

    def stop(self) -> int:
        self.stopping.set()
        self.join(5)
        return self.most


def _measured(created, elapsed, web_cpu, database_cpu, statuses, watch) -> dict:
    """One measurement's figures: rates, CPU per job, answers seen, connections held."""
    return {
        "seconds": round(elapsed, 2),
        "jobs_created": created,
        "jobs_per_second": round(created / elapsed, 1),
        "web_cpu_ms_per_job": round(1000 * web_cpu / max(created, 1), 3),
        "database_cpu_ms_per_job": round(1000 * database_cpu / max(created, 1), 3),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "most_db_connections": watch.stop(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.api",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--bulk-requests", type=int, default=20)
    parser.add_argument("--bulk-size", type=int, default=1000)
    parser.add_argument("--bulk-clients", type=int, default=2)
    parser.add_argument("--web-workers", type=int, default=max(2, min(8, 2 * os.cpu_count())))
    parser.add_argument("--no-keys", dest="keys", action="store_false")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    with bench_environment("bench_api", task_modules="tests.sample_tasks") as (env, workdir):
        figures = run(args, env, workdir)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def run(args, env: dict, workdir: Path) -> dict:
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from jobs.models import Job

    clients = max(args.clients, args.bulk_clients)
    from jobs.tokens import token_create

    now = dt.datetime.now(dt.UTC)
    tokens = [
        token_create(owner=get_user_model().objects.create_user(f"bench{i}"), now=now)[1]
        for i in range(clients)
    ]
    port = _free_port()
    # As `standalone` runs it (dispatch/management/commands/standalone.py: web_argv).
    argv = [sys.executable, "-m", "gunicorn", "scheduler_project.wsgi:application",
            "--bind", f"127.0.0.1:{port}", "--chdir", str(ROOT), "--timeout", "120",
            "--workers", str(args.web_workers), "--worker-class", "sync"]  # fmt: skip
    log = open(workdir / "gunicorn.log", "ab")  # noqa: SIM115
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=log, cwd=ROOT)
    figures: dict = {"web_workers": args.web_workers, "keys": args.keys}
    try:
        deadline = time.monotonic() + 60
        while _post(port, tokens[0], "/api/v1/jobs/", BODY) != 400:  # up: a 400 (no name)
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"gunicorn did not start; see {workdir / 'gunicorn.log'}")
            time.sleep(0.2)
        database = settings.DATABASES["default"]["NAME"]
        context = multiprocessing.get_context("fork")

        before = Job.objects.count()
        watch = ConnectionWatch(database)
        watch.start()
        meter = CpuMeter(server.pid, database)
        start_at = time.time() + 1.0
        with context.Pool(args.clients) as pool:
            results = pool.starmap(
                _single_client,
                [(port, tokens[i], args.seconds, args.keys, start_at) for i in range(args.clients)],
            )
        elapsed = time.time() - start_at
        web_cpu, database_cpu = meter.spent()
        statuses = sum(results, Counter())
        created = Job.objects.count() - before
        figures["single"] = {
            "clients": args.clients,
            **_measured(created, elapsed, web_cpu, database_cpu, statuses, watch),
        }
        print(
            f"POST /jobs/: {created / elapsed:.0f} jobs/s ({args.clients} clients); CPU per "
            f"job: web {figures['single']['web_cpu_ms_per_job']:.2f} ms, database "
            f"{figures['single']['database_cpu_ms_per_job']:.2f} ms"
        )

        for name, path, floor_tokens in (
            ("floor", "/healthz", [None] * args.clients),
            ("drf_floor", "/api/v1/schedules/preview/", tokens[: args.clients]),
        ):
            start_at = time.time() + 1.0
            meter = CpuMeter(server.pid, database)
            with context.Pool(args.clients) as pool:
                results = pool.starmap(
                    _floor_client, [(port, args.seconds, start_at, t) for t in floor_tokens]
                )
            elapsed = time.time() - start_at
            web_cpu, _ = meter.spent()
            answered = sum(results, Counter())
            floor = answered[200] / elapsed
            figures[name] = {
                "clients": args.clients, "path": path, "seconds": round(elapsed, 2),
                "requests_per_second": round(floor, 1),
                "web_cpu_ms_per_request": round(1000 * web_cpu / max(answered[200], 1), 3),
                "statuses": {str(k): v for k, v in sorted(answered.items())},
                "single_share_of_floor": round(figures["single"]["jobs_per_second"] / floor, 3),
            }  # fmt: skip
            print(
                f"{'GET' if name == 'floor' else 'POST'} {path} ({name}): {floor:.0f} "
                f"requests/s ({args.clients} clients), web CPU "
                f"{figures[name]['web_cpu_ms_per_request']:.2f} ms a request; POST /jobs/ is "
                f"{figures[name]['single_share_of_floor']:.0%} of it"
            )

        before = Job.objects.count()
        watch = ConnectionWatch(database)
        watch.start()
        share = [args.bulk_requests // args.bulk_clients] * args.bulk_clients
        share[0] += args.bulk_requests - sum(share)
        meter = CpuMeter(server.pid, database)
        started = time.time()
        with context.Pool(args.bulk_clients) as pool:
            results = pool.starmap(
                _bulk_client,
                [(port, tokens[i], n, args.bulk_size, args.keys) for i, n in enumerate(share)],
            )
        elapsed = time.time() - started
        web_cpu, database_cpu = meter.spent()
        statuses = sum(results, Counter())
        created = Job.objects.count() - before
        figures["bulk"] = {
            "clients": args.bulk_clients,
            "requests": args.bulk_requests,
            "size": args.bulk_size,
            **_measured(created, elapsed, web_cpu, database_cpu, statuses, watch),
        }
        print(
            f"POST /jobs/bulk/: {created / elapsed:.0f} jobs/s ({args.bulk_clients} clients); "
            f"CPU per job: web {figures['bulk']['web_cpu_ms_per_job']:.3f} ms, database "
            f"{figures['bulk']['database_cpu_ms_per_job']:.3f} ms"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
        from django.db import connections

        connections.close_all()
    return figures


if __name__ == "__main__":
    main()
