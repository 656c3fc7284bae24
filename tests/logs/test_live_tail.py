"""Live tail over real HTTP: a client following a running attempt of a real worker sees
each line within 2 seconds of its writing, and its stream ends when the attempt ends."""

import datetime as dt
import time

import pytest
import requests

from jobs.models import Attempt, Run, RunState
from tests.factories import one_time_job, owner, token_for
from tests.processes import wait_for

pytestmark = pytest.mark.slow


def test_following_a_running_attempt_sees_lines_within_two_seconds(
    stack, live_server, report_figure
):
    stack.scheduler()
    stack.relay()
    stack.worker()
    token = token_for(owner())
    job = one_time_job(task="faults.chatty", args=[20, 6.0])
    run = wait_for(lambda: Run.objects.filter(job=job).first(), timeout=30, message="the run")
    wait_for(lambda: Attempt.objects.filter(run=run).exists(), timeout=30,
             message="the attempt to start")  # fmt: skip

    url = f"{live_server.url}/api/v1/runs/{run.id}/logs/?follow=true&wait=5"
    seen, lags, ended = [], [], False
    deadline = time.monotonic() + 60
    while url and time.monotonic() < deadline:
        response = requests.get(url, headers={"Authorization": f"Token {token}"}, timeout=30)
        assert response.status_code == 200, response.text
        page = response.json()
        received = dt.datetime.now(dt.UTC)
        for line in page["lines"]:
            seen.append(line["text"])
            lags.append((received - dt.datetime.fromisoformat(line["ts"])).total_seconds())
        ended = page["ended"]
        url = page["next"]

    assert ended and url is None
    assert seen == [f"attempt 1 line {index}" for index in range(20)]
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED
    assert max(lags) <= 2.0, lags
    report_figure(
        f"live tail over HTTP: line lag max {max(lags):.2f}s, median {sorted(lags)[10]:.2f}s"
    )
