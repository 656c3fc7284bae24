"""Live log tails against `standalone`: does the web tier still answer while 20 tails wait?

    .venv/bin/python -m bench.tails --tails 20 --seconds 20

Creates a fresh PostgreSQL database and RabbitMQ vhost (dropped afterwards), starts
`manage.py standalone` on them (web, scheduler, relay, worker, as a user runs it), starts one
long, silent run (`tests.sleep`), and opens --tails live tails of its log (each a loop of
`GET /api/v1/runs/{id}/logs/?follow=true&wait=25`, honouring 429's Retry-After) from
--users users, while one client measures `GET /healthz` one request after another for
--seconds. Twice in the same run: with the tails bounded as standalone bounds them
(logs_app.tails: all web workers but two may hold a waiting tail, two per user), and,
as the baseline, unbounded (the bounds set to 1000). Prints /healthz p50, p99 and max, and
the tails' answers by status.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from bench.common import ROOT, bench_environment

HEALTHZ_TIMEOUT = 40.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(port: int, path: str, token: str | None = None, timeout: float = 40.0):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Authorization": f"Token {token}"} if token else {}
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        body = response.read()
        return response.status, response.getheader("Retry-After"), body
    finally:
        connection.close()


def _tail(port: int, token: str, run_id: str, stop: threading.Event, statuses: Counter):
    while not stop.is_set():
        try:
            status, retry_after, _ = _get(
                port, f"/api/v1/runs/{run_id}/logs/?follow=true&wait=25", token
            )
        except OSError:
            status, retry_after = "error", "1"
        statuses[status] += 1
        if status != 200:
            stop.wait(float(retry_after or 1))


def _measure(port: int, tokens: list[str], run_id: str, args) -> dict:
    stop, statuses = threading.Event(), Counter()
    tails = [
        threading.Thread(
            target=_tail,
            args=(port, tokens[i % len(tokens)], run_id, stop, statuses),
            daemon=True,
        )  # fmt: skip
        for i in range(args.tails)
    ]
    for thread in tails:
        thread.start()
    time.sleep(3)  # the tails are open and waiting
    latencies, failures = [], 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            status, _, _ = _get(port, "/healthz", timeout=HEALTHZ_TIMEOUT)
        except OSError:
            status = None
        latencies.append(time.monotonic() - started)
        failures += status != 200
        time.sleep(0.05)
    stop.set()
    latencies.sort()
    return {
        "healthz_requests": len(latencies),
        "healthz_failures": failures,
        "healthz_p50_ms": 1000 * statistics.median(latencies),
        "healthz_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "healthz_max_ms": 1000 * latencies[-1],
        "tail_answers": {str(k): v for k, v in sorted(statuses.items(), key=str)},
    }


def _standalone(env: dict, workdir: Path, port: int, label: str, extra: dict):
    log = open(workdir / f"standalone-{label}.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "manage.py", "standalone", "--port", str(port)],
        cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        try:
            if _get(port, "/healthz", timeout=5)[0] == 200:
                return process
        except OSError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise SystemExit(f"standalone did not start; see {workdir}/standalone-{label}.log")
        time.sleep(0.5)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run(args, env: dict, workdir: Path) -> dict:
    import datetime as dt

    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from jobs.api.validation import JobSpecSerializer
    from jobs.models import Run, RunState
    from jobs.roles import OPERATORS_GROUP
    from jobs.services import job_create
    from jobs.tokens import token_create

    now = dt.datetime.now(dt.UTC)
    # Operators: each may read the one run's log, whoever owns it.
    operators = Group.objects.get_or_create(name=OPERATORS_GROUP)[0]
    users = [get_user_model().objects.create_user(f"tail{i}") for i in range(args.users)]
    for user in users:
        user.groups.add(operators)
    tokens = [token_create(owner=user, now=now)[1] for user in users]
    figures = {"tails": args.tails, "users": args.users, "seconds": args.seconds}
    for label, extra in (
        ("bounded", {}),
        ("unbounded", {"SCHEDULER_LOG_FOLLOW_MAX_WAITING": "1000",
                       "SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER": "1000"}),
    ):  # fmt: skip
        port = _free_port()
        process = _standalone(env, workdir, port, label, extra)
        try:
            spec = JobSpecSerializer(data={
                "name": f"silent {label}", "task": "tests.sleep", "kwargs": {"seconds": 300},
                "schedule": {"kind": "once", "run_at": dt.datetime.now(dt.UTC).isoformat()},
                "timeout_seconds": 600,
            })  # fmt: skip
            spec.is_valid(raise_exception=True)
            job = job_create(owner=users[0], spec=dict(spec.validated_data),
                             now=dt.datetime.now(dt.UTC))  # fmt: skip
            deadline = time.monotonic() + 90
            while not Run.objects.filter(job=job, state=RunState.RUNNING).exists():
                if time.monotonic() > deadline:
                    raise SystemExit("the silent run never started")
                time.sleep(0.5)
            run_id = str(Run.objects.get(job=job).id)
            measured = _measure(port, tokens, run_id, args)
        finally:
            _stop(process)
        figures[label] = measured
        print(
            f"{label:>9}: {args.tails} tails from {args.users} users; /healthz p50 "
            f"{measured['healthz_p50_ms']:.1f} ms, p99 {measured['healthz_p99_ms']:.1f} ms, "
            f"max {measured['healthz_max_ms']:.1f} ms over {measured['healthz_requests']} "
            f"requests ({measured['healthz_failures']} failed); tail answers "
            f"{measured['tail_answers']}",
            flush=True,
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tails",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tails", type=int, default=20)
    parser.add_argument("--users", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    with bench_environment("bench_tails", task_modules="tests.sample_tasks") as (env, workdir):
        figures = run(args, env, workdir)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
