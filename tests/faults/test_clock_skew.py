"""Processes whose clocks are wrong (libfaketime): a scheduler and a relay 5 minutes fast, a
worker 5 minutes slow. No run is created or started before it is due on the database's
clock, none is lost, no lease is taken from the slow worker (every attempt succeeds, none
is reaped), and /metrics shows each process's skew. Web processes a day apart throttle and
expire tokens as the database's clock says."""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import time
from email.utils import parsedate_to_datetime

import pytest
import requests
from django.db.models import Q

from dispatch.commands import worker_argv
from dispatch.management.commands.standalone import web_argv
from jobs.clock import db_now
from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.tokens import token_create
from tests import factories
from tests.faults.helpers import counter
from tests.jobs.test_metrics import scrape
from tests.jobs.test_throttling import free_port, web_up
from tests.processes import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.faults,
    pytest.mark.skipif(
        shutil.which("faketime") is None,
        reason="needs libfaketime's `faketime` command (Debian package faketime)",
    ),
]

SKEW = 300


def faked(seconds: int) -> list[str]:
    # Only the wall clock (the skew under test); libfaketime's monotonic clock would hang
    # Event waits. Then time.sleep fails under it (EINVAL): the long task waits on an Event.
    return ["env", "FAKETIME_DONT_FAKE_MONOTONIC=1", "faketime", "-f", f"{seconds:+d}"]


def test_fast_scheduler_and_relay_slow_worker_run_nothing_early_and_steal_no_lease(
    stack, operator_api, report_figure
):
    python = [sys.executable, "manage.py"]
    stack.start("scheduler", faked(SKEW) + python + ["scheduler", "--poll-interval", "0.5"])
    stack.start("relay", faked(SKEW) + python + ["relay"])
    worker = stack.start(
        "worker", faked(-SKEW) + worker_argv(name="slow", concurrency=2, queues=["jobs"])
    )
    wait_for(lambda: b" ready." in stack.log("worker") or worker.poll() is not None,
             timeout=60, message="the slow worker to be ready")  # fmt: skip
    start = db_now()
    owner = factories.owner()
    # Due over the next 15 s on the database's clock (this process's clock is the
    # database's: same host, not faked): a fast scheduler would create them minutes early.
    jobs = [
        factories.one_time_job(task="tests.record", due_at=start + dt.timedelta(seconds=3 + n))
        for n in range(12)
    ]
    # Twice its heartbeat timeout: its lease lives only through the slow worker's renewals
    # (every 2 s), judged by a fast scheduler's reaper; 6 s leaves room for a loaded box.
    jobs.append(
        factories.one_time_job(
            task="faults.wait",
            args=[12],
            heartbeat_timeout_seconds=6,
            due_at=start + dt.timedelta(seconds=3),
        )
    )
    interval = factories.make_job(owner, now=start, task="tests.record",
                                  schedule={"kind": "interval", "every_seconds": 2})  # fmt: skip

    def all_done() -> bool:
        # Watched as it happens: a run of an occurrence still ahead on the database's clock
        # would be one made early (a fast scheduler trusting its own clock makes every run
        # due within 5 minutes at once, and stamps it 5 minutes ahead).
        now = db_now()
        early = Run.objects.filter(job__in=[*jobs, interval]).filter(
            Q(scheduled_for__gt=now) | Q(created_at__gt=now) | Q(started_at__gt=now)
        )
        assert not early.exists(), list(early.values("scheduled_for", "created_at"))
        return Run.objects.filter(job__in=jobs, state=RunState.SUCCEEDED).count() == len(jobs)

    wait_for(all_done, timeout=120, message="every one-time run to succeed")
    time.sleep(2)

    runs = list(Run.objects.filter(job__in=[*jobs, interval]).prefetch_related("attempts"))
    assert len(runs) >= len(jobs) + 5
    for run in runs:
        assert run.created_at >= run.scheduled_for, f"{run.id} created before it was due"
        assert run.created_at <= db_now()
        for attempt in run.attempts.all():
            assert attempt.started_at is None or attempt.started_at >= run.scheduled_for
    attempts = Attempt.objects.filter(run__in=runs)
    assert not attempts.exclude(state__in=[AttemptState.SUCCEEDED, AttemptState.RUNNING])
    assert all(run.attempt_count == 1 for run in runs if run.state == RunState.SUCCEEDED)
    assert counter("scheduler_lease_expired_total") == 0
    executed = [e["run_id"] for e in stack.executions() if e["event"] == "executed"]
    assert len(executed) == len(set(executed))  # nothing twice

    def skews():
        samples = scrape(operator_api.get("/metrics").content.decode())
        return {
            dict(labels)["kind"]: value
            for (name, labels), value in samples.items()
            if name == "scheduler_clock_skew_seconds"
        }

    seen = wait_for(lambda: (lambda s: s if len(s) == 3 else None)(skews()), timeout=30,
                    message="the three processes' skews on /metrics")  # fmt: skip
    report_figure(
        "clock skew on /metrics: "
        + ", ".join(f"{kind} {value:+.3f} s" for kind, value in sorted(seen.items()))
    )
    assert seen["scheduler"] == pytest.approx(SKEW, abs=2)
    assert seen["relay"] == pytest.approx(SKEW, abs=2)
    assert seen["worker"] == pytest.approx(-SKEW, abs=2)


def test_web_processes_a_day_apart_throttle_and_expire_tokens_on_the_databases_clock(stack):
    """Two gunicorn processes, one a day fast and one a day slow (libfaketime), requests
    alternating: the rate is the rate (each process's own clock would put every request in
    a new window: all allowed), and a token lives exactly as long as the database's clock
    says on both (the fast one refusing a live token, the slow one taking an expired one)."""
    limit, day = 10, 86_400
    ports = {"fast": free_port(), "slow": free_port()}
    for name, seconds in (("fast", day), ("slow", -day)):
        argv = web_argv(host="127.0.0.1", port=ports[name], workers=1)
        # Monotonic faked too: gunicorn's sleeps fail under the wall clock alone (EINVAL),
        # and a sync worker waits on no Event.
        stack.start(
            name,
            ["faketime", "-f", f"{seconds:+d}", *argv],
            {"SCHEDULER_THROTTLE_RATES": f"user={limit}/day"},
        )
    for name, port in ports.items():
        wait_for(lambda port=port: web_up(port), timeout=60, message=f"the {name} web")

    def answer(name: str, token: str) -> requests.Response:
        url = f"http://127.0.0.1:{ports[name]}/api/v1/runs/"
        return requests.get(url, headers={"Authorization": f"Token {token}"}, timeout=30)

    def get(name: str, token: str) -> int:
        return answer(name, token).status_code

    # Their clocks are off indeed: gunicorn dates its answers with its own.
    for name, seconds in (("fast", day), ("slow", -day)):
        dated = parsedate_to_datetime(answer(name, "none").headers["Date"])
        assert (dated - db_now()).total_seconds() == pytest.approx(seconds, abs=60)

    owner = factories.owner()
    token = factories.token_for(owner)
    answers = [get(("fast", "slow")[index % 2], token) for index in range(2 * limit)]
    assert answers == [200] * limit + [429] * limit

    now, hour = db_now(), dt.timedelta(hours=1)
    live = token_create(owner=factories.owner("live"), now=now, ttl=hour)[1]
    expired = token_create(owner=factories.owner("expired"), now=now - 2 * hour, ttl=hour)[1]
    assert (get("fast", live), get("slow", live)) == (200, 200)
    assert (get("fast", expired), get("slow", expired)) == (401, 401)
