"""Profile of POST /api/v1/jobs/ in one process: where a creation's web CPU goes.

    .venv/bin/python -m bench.profile_api --requests 2000 [--profile 30] [--no-keys]
    .venv/bin/python -m bench.profile_api --bulk 1000 --requests 5   # POST /jobs/bulk/
    .venv/bin/python -m bench.profile_api --preview --requests 2000  # bench.api's DRF floor

Creates a fresh PostgreSQL database (dropped afterwards), then sends N creations through
Django's full request cycle (middleware, DRF, the database) with Django's test client, in
this process and without HTTP, and prints requests/s of that process alone. `--profile`
repeats them under cProfile and prints the functions that took the most time (cProfile
slows Python down: the rate without it is the figure). The HTTP figure, with gunicorn and
concurrent clients, is bench.api's.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.api import BODY, PREVIEW
from bench.common import bench_environment, print_profile


def _post(client, token: str, path: str, body, expected: int, **headers) -> None:
    response = client.post(
        f"/api/v1{path}", json.dumps(body), content_type="application/json",
        HTTP_HOST="127.0.0.1", HTTP_AUTHORIZATION=f"Token {token}", **headers,
    )  # fmt: skip
    if response.status_code != expected:
        raise SystemExit(f"POST {path} answered {response.status_code}: {response.content}")


def _creations(client, token: str, count: int, keys: bool, prefix: str) -> float:
    started = time.perf_counter()
    for index in range(count):
        headers = {"HTTP_IDEMPOTENCY_KEY": f"{prefix}-{index}"} if keys else {}
        _post(client, token, "/jobs/", {**BODY, "name": f"{prefix}{index}"}, 201, **headers)
    return time.perf_counter() - started


def _previews(client, token: str, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        _post(client, token, "/schedules/preview/", PREVIEW, 200)
    return time.perf_counter() - started


def _bulks(client, token: str, count: int, size: int, keys: bool, prefix: str) -> float:
    started = time.perf_counter()
    for request in range(count):
        items = [
            {**BODY, "name": f"{prefix}{request}-{i}",
             **({"idempotency_key": f"{prefix}-{request}-{i}"} if keys else {})}
            for i in range(size)
        ]  # fmt: skip
        _post(client, token, "/jobs/bulk/", items, 201)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_api",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N")
    parser.add_argument("--no-keys", dest="keys", action="store_false")
    parser.add_argument("--bulk", type=int, default=0, help="POST /jobs/bulk/ of this size")
    parser.add_argument("--preview", action="store_true", help="the DRF floor (bench.api)")
    args = parser.parse_args()
    with bench_environment("bench_profile_api", task_modules="tests.sample_tasks"):
        import datetime as dt

        from django.contrib.auth import get_user_model
        from django.test import Client

        from jobs.tokens import token_create

        owner = get_user_model().objects.create_user("bench")
        token = token_create(owner=owner, now=dt.datetime.now(dt.UTC))[1]
        client = Client(SERVER_NAME="127.0.0.1")
        if args.preview:

            def send(prefix):
                return _previews(client, token, args.requests)

            jobs = args.requests
        elif args.bulk:

            def send(prefix):
                return _bulks(client, token, args.requests, args.bulk, args.keys, prefix)

            jobs = args.requests * args.bulk
        else:

            def send(prefix):
                return _creations(client, token, args.requests, args.keys, prefix)

            jobs = args.requests
        send("warm")
        elapsed = send("timed")
        path = "/schedules/preview/" if args.preview else "/jobs/bulk/" if args.bulk else "/jobs/"
        print(
            f"POST {path} in one process: "
            f"{jobs / elapsed:.0f} jobs/s, {1000 * elapsed / jobs:.3f} ms a job"
        )
        if args.profile:
            print_profile(lambda: send("profiled"), args.profile)


if __name__ == "__main__":
    main()
