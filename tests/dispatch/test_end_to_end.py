"""A job travels from the REST API through PostgreSQL, the outbox and RabbitMQ to a real
Celery worker, and back: real HTTP, real processes."""

import datetime as dt

import pytest
import requests

from jobs.models import Run, RunState
from tests.factories import token_for
from tests.processes import wait_for

pytestmark = pytest.mark.slow


def _run_at(seconds: float) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)).isoformat()


@pytest.fixture
def http(live_server, user):
    session = requests.Session()
    session.headers["Authorization"] = f"Token {token_for(user)}"
    session.base = f"{live_server.url}/api/v1"
    return session


def test_one_time_job_due_in_two_seconds_runs_once(stack, http):
    stack.scheduler()
    stack.relay()
    stack.worker()
    created = http.post(
        f"{http.base}/jobs/",
        json={
            "name": "hello",
            "task": "tests.record",
            "args": [1, "two"],
            "kwargs": {"k": 3},
            "schedule": {"kind": "once", "run_at": _run_at(2)},
        },
    )
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]

    def finished_run():
        runs = http.get(f"{http.base}/runs/", params={"job": job_id}).json()["results"]
        return runs if runs and runs[0]["state"] in ("succeeded", "failed") else None

    runs = wait_for(finished_run, timeout=30, message="the run to finish")
    assert len(runs) == 1
    run = http.get(f"{http.base}/runs/{runs[0]['id']}/").json()
    assert run["state"] == "succeeded"
    assert run["result"] == {"ok": True, "args": [1, "two"]}
    assert [a["state"] for a in run["attempts"]] == ["succeeded"]
    assert run["attempts"][0]["fencing_token"] == 1
    stages = run["timestamps"]
    assert all(stages[stage] for stage in ("due", "created", "published", "started", "finished")), (
        stages
    )
    order = [
        dt.datetime.fromisoformat(stages[s].replace("Z", "+00:00"))
        for s in ("created", "published", "started", "finished")
    ]
    assert order == sorted(order)
    executions = stack.executions()
    assert [(e["run_id"], e["args"], e["kwargs"]) for e in executions] == [
        (run["id"], [1, "two"], {"k": 3})
    ]


def test_failing_handler_is_retried_with_backoff_then_failed(stack, make_job):
    stack.scheduler()
    stack.relay()
    stack.worker()
    job = make_job(
        task="tests.fail",
        schedule={"kind": "once", "run_at": _run_at(0.5)},
        retry={"max_attempts": 3, "initial_delay_seconds": 1, "backoff_factor": 2, "jitter": False},
    )
    run = wait_for(
        lambda: Run.objects.filter(job=job, state=RunState.FAILED).first(),
        timeout=60,
        message="the run to fail",
    )
    assert run.failure_reason == "exhausted"
    attempts = list(run.attempts.order_by("number"))
    assert [(a.number, a.state, a.fencing_token) for a in attempts] == [
        (1, "failed", 1),
        (2, "failed", 2),
        (3, "failed", 3),
    ]
    assert all("RuntimeError: boom" in a.error for a in attempts)
    # Backoff: 1 s after the first failure, 2 s after the second (no jitter).
    gaps = [
        (b.started_at - a.finished_at).total_seconds()
        for a, b in zip(attempts, attempts[1:], strict=False)
    ]
    assert gaps[0] >= 1.0 and gaps[1] >= 2.0, gaps
    assert len(stack.executions()) == 3


def test_a_worker_keeps_its_database_connections_across_runs(stack, user):
    """Each pool process opens its connection once, not once per run (Celery's Django
    fix-up would close it around every task without CELERY_DB_REUSE_MAX)."""
    from django.db import connection

    from jobs.api.validation import JobSpecSerializer
    from jobs.services import job_create

    def sessions() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
            )
            return cursor.fetchone()[0]

    stack.relay()
    stack.worker(concurrency=2)
    now = dt.datetime.now(dt.UTC)
    for index in range(60):
        spec = JobSpecSerializer(
            data={"name": f"j{index}", "task": "tests.record",
                  "schedule": {"kind": "once", "run_at": now.isoformat()}}
        )  # fmt: skip
        spec.is_valid(raise_exception=True)
        job_create(owner=user, spec=spec.validated_data, now=now)
    before = sessions()
    stack.scheduler()
    wait_for(
        lambda: Run.objects.filter(state=RunState.SUCCEEDED).count() == 60,
        timeout=60,
        message="60 runs to succeed",
    )
    # The scheduler's loops and the relay open a few of their own; 60 runs opening one
    # each would show here.
    assert sessions() - before < 20


def test_packed_runs_each_run_once_with_their_own_attempt(stack, user):
    """45 runs of a task declared pack=20 travel in 3 messages to real workers; each run is
    claimed, run and recorded on its own, with every stage stamped."""
    from jobs.api.validation import JobSpecSerializer
    from jobs.models import Attempt, AttemptState
    from jobs.services import job_create

    now = dt.datetime.now(dt.UTC)
    for index in range(45):
        spec = JobSpecSerializer(
            data={"name": f"p{index}", "task": "tests.record_packed", "args": [index],
                  "schedule": {"kind": "once", "run_at": now.isoformat()}}
        )  # fmt: skip
        spec.is_valid(raise_exception=True)
        job_create(owner=user, spec=spec.validated_data, now=now)
    stack.worker(concurrency=2)
    stack.relay()
    stack.scheduler()
    wait_for(
        lambda: Run.objects.filter(state=RunState.SUCCEEDED).count() == 45,
        timeout=60,
        message="45 packed runs to succeed",
    )
    runs = list(Run.objects.all())
    assert len(runs) == 45
    assert all(
        run.result == {"ok": True, "args": [run.job_version.spec["args"][0]]} for run in runs
    )
    assert all(run.published_at and run.started_at and run.finished_at for run in runs)
    assert Attempt.objects.filter(state=AttemptState.SUCCEEDED, fencing_token=1).count() == 45
    assert Attempt.objects.count() == 45
    executions = stack.executions()
    assert sorted(e["run_id"] for e in executions) == sorted(str(run.id) for run in runs)
