"""The histograms and the attempt counter after a known workload on real processes
(scheduler, relay, worker), scraped from two web processes: both show what the database
holds, as every process's events were counted where they committed."""

import socket
from collections import Counter

import pytest
import requests
from django.contrib.auth import get_user_model
from django.db.models import F

from dispatch.management.commands.standalone import web_argv
from jobs.models import Attempt, Run, RunState
from tests import factories
from tests.jobs.test_metrics import histogram, scrape
from tests.processes import wait_for

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_web_processes_export_the_runs_and_attempts_in_the_database(stack):
    ports = [free_port(), free_port()]
    for n, port in enumerate(ports):
        stack.start(f"web{n}", web_argv(host="127.0.0.1", port=port, workers=1))
    stack.scheduler()
    stack.relay()
    stack.worker(concurrency=2)
    retry = {"max_attempts": 2, "initial_delay_seconds": 0, "jitter": False}
    jobs = [factories.one_time_job(task="tests.record", due_in=1, args=[n]) for n in range(6)]
    jobs += [factories.one_time_job(task="tests.fail", due_in=1, retry=retry) for _ in range(2)]
    terminal = Run.objects.filter(job__in=jobs, state__in=[RunState.SUCCEEDED, RunState.FAILED])
    wait_for(lambda: terminal.count() == len(jobs), timeout=90, message="every run to end")

    operator = get_user_model().objects.create_superuser("metrics-scraper")  # /metrics: operators
    token = factories.token_for(operator)
    session = requests.Session()
    session.headers["Authorization"] = f"Token {token}"

    def scraped(port: int) -> dict:
        response = session.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert response.status_code == 200, response.text[:500]
        return scrape(response.text)

    wait_for(lambda: all(_answers(session, port) for port in ports), timeout=60, message="web")
    first, second = (scraped(port) for port in ports)
    assert first == second

    runs = Run.objects.all()
    started = runs.filter(started_at__isnull=False, published_at__isnull=False)
    finished = runs.filter(started_at__isnull=False, finished_at__isnull=False)
    assert histogram(first, "scheduler_discovery_lag_seconds")[0] == runs.count() == 8
    assert histogram(first, "scheduler_publish_lag_seconds")[0] == started.count() == 8
    assert histogram(first, "scheduler_queue_wait_seconds")[0] == started.count()
    count, total, _ = histogram(first, "scheduler_run_duration_seconds")
    durations = [
        d.total_seconds()
        for d in finished.annotate(d=F("finished_at") - F("started_at")).values_list("d", flat=True)
    ]
    assert (count, total) == (len(durations), pytest.approx(sum(durations)))
    outcomes = Counter(Attempt.objects.values_list("state", flat=True))
    assert outcomes == {"succeeded": 6, "failed": 4}
    for outcome, expected in outcomes.items():
        assert first[("scheduler_attempts_total", (("outcome", outcome),))] == expected


def _answers(session: requests.Session, port: int) -> bool:
    try:
        return session.get(f"http://127.0.0.1:{port}/healthz", timeout=5).ok
    except requests.ConnectionError:
        return False
