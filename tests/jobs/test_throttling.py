"""Throttling (jobs.throttling): per user, tighter on bulk, backfill and log follow, the
admin's login throttled, and counted in the database that every web process shares: across
3 gunicorn processes the limit is the limit, not 3 times it."""

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import requests
from django.contrib.auth import get_user_model
from rest_framework.throttling import SimpleRateThrottle

from dispatch.management.commands.standalone import web_argv
from tests.factories import api_client, job_body, running_attempt, token_for
from tests.processes import wait_for

ALL_OPEN = {
    scope: "100000/min" for scope in ("user", "bulk", "backfill", "logs_follow", "admin_login")
}


@pytest.fixture
def rates(monkeypatch):
    """set(scope=rate, ...): those rates, the others out of the way. (DRF's throttles read
    their rates once, at import, so the settings fixture cannot change them.)"""

    def set_rates(**scoped):
        monkeypatch.setattr(SimpleRateThrottle, "THROTTLE_RATES", {**ALL_OPEN, **scoped})

    return set_rates


def test_bulk_has_its_own_tighter_rate_per_user(api, other_user, rates):
    rates(bulk="2/day")
    for _ in range(2):
        assert api.post("/api/v1/jobs/bulk/", [job_body()], format="json").status_code == 201
    refused = api.post("/api/v1/jobs/bulk/", [job_body()], format="json")
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert api.post("/api/v1/jobs/", job_body(), format="json").status_code == 201
    other = api_client(other_user)
    assert other.post("/api/v1/jobs/bulk/", [job_body()], format="json").status_code == 201


def test_every_request_counts_against_the_users_rate(api, rates):
    rates(user="3/day")
    assert [api.get("/api/v1/runs/").status_code for _ in range(4)] == [200, 200, 200, 429]


def test_following_logs_has_its_own_rate_reading_them_does_not(queued_run, rates):
    attempt = running_attempt(queued_run)
    api = api_client(attempt.run.job.owner)
    url = f"/api/v1/runs/{attempt.run_id}/logs/"
    rates(logs_follow="1/day")
    assert api.get(url, {"follow": "true", "wait": 0}).status_code == 200
    assert api.get(url, {"follow": "true", "wait": 0}).status_code == 429
    # Every spelling the view takes for true is a follow (DRF's BooleanField).
    for spelling in ("t", "y", "on", "1", "True"):
        assert api.get(url, {"follow": spelling, "wait": 0}).status_code == 429, spelling
    assert api.get(url).status_code == 200


def test_admin_login_attempts_are_throttled_per_client_address(client, rates, user):
    rates(admin_login="3/day")
    for _ in range(3):
        response = client.post("/admin/login/", {"username": user.username, "password": "x"})
        assert response.status_code == 200  # the form again, with its error
    refused = client.post("/admin/login/", {"username": user.username, "password": "pw"})
    assert refused.status_code == 429 and "Retry-After" in refused
    assert client.get("/admin/login/").status_code == 200  # the page itself is not counted


def test_the_window_is_the_databases_when_web_processes_clocks_differ(user, rates):
    """Two web processes, one a day fast, requests alternating: the rate holds. A window
    taken from each process's clock differs between them, and each hit would start the
    count over (all 20 allowed)."""
    rates(user="10/day")
    true, skewed = api_client(user), api_client(user)
    fast = mock.patch("time.time", side_effect=lambda real=time.time: real() + 86_400)

    def get(index: int) -> int:
        if index % 2 == 0:
            return true.get("/api/v1/runs/").status_code
        with fast:
            return skewed.get("/api/v1/runs/").status_code

    assert [get(index) for index in range(20)] == [200] * 10 + [429] * 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def web_up(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).ok
    except (requests.ConnectionError, requests.Timeout):
        return False


@pytest.mark.slow
def test_the_limit_holds_across_three_web_processes(stack, user):
    limit = 12
    env = {"SCHEDULER_THROTTLE_RATES": f"user={limit}/day"}
    ports = [free_port() for _ in range(3)]
    for index, port in enumerate(ports):
        stack.start(f"web{index}", web_argv(host="127.0.0.1", port=port, workers=1), env)

    for port in ports:
        wait_for(lambda port=port: web_up(port), timeout=60, message=f"web on {port}")

    def get(token: str, index: int) -> int:
        url = f"http://127.0.0.1:{ports[index % 3]}/api/v1/runs/"
        headers = {"Authorization": f"Token {token}"}
        return requests.get(url, headers=headers, timeout=30).status_code

    # Round robin, one at a time: each process alone would allow `limit`.
    token = token_for(user)
    assert [get(token, index) for index in range(limit + 6)] == [200] * limit + [429] * 6
    # At once, 24 clients over the 3 processes: exactly `limit` get through.
    token = token_for(get_user_model().objects.create_user("concurrent"))
    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda index: get(token, index), range(limit + 12)))
    assert sorted(answers) == [200] * limit + [429] * 12
