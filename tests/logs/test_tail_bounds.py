"""Live tails that wait are bounded per host and per user (logs_app.tails): past either
bound a follow answers 429 with Retry-After at once instead of holding a web worker; a
slot is free again once its request ends."""

from __future__ import annotations

import time

import pytest

from logs_app.tails import tail_slot
from tests.factories import claim, owner

pytestmark = pytest.mark.django_db


@pytest.fixture
def bounds(settings, tmp_path):
    settings.SCHEDULER_LOG_FOLLOW_SLOTS_DIR = str(tmp_path)
    settings.SCHEDULER_LOG_FOLLOW_MAX_WAITING = 2
    settings.SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER = 1
    return settings


def _follow(api, run, wait: int = 1):
    started = time.monotonic()
    response = api.get(f"/api/v1/runs/{run.id}/logs/", {"follow": "true", "wait": wait})
    return response, time.monotonic() - started


def test_a_tail_past_the_users_bound_answers_429_at_once(bounds, queued_run, user, api):
    run = queued_run()
    claim(run)
    with tail_slot(user_id=user.pk) as held:  # the user's one slot, held by another tail
        assert held
        response, took = _follow(api, run, wait=5)
        assert response.status_code == 429 and took < 3
        assert response["Retry-After"] == "5" and "live tails" in response.json()["detail"]
        plain = api.get(f"/api/v1/runs/{run.id}/logs/")  # not following: not bounded
        assert plain.status_code == 200
    response, _ = _follow(api, run)  # released: it waits, and answers
    assert response.status_code == 200 and response.json()["lines"] == []


def test_a_tail_past_the_hosts_bound_answers_429(bounds, queued_run, user, api):
    run = queued_run()
    claim(run)
    others = [owner(f"tail-{n}") for n in range(2)]
    with tail_slot(user_id=others[0].pk), tail_slot(user_id=others[1].pk):
        assert _follow(api, run)[0].status_code == 429
    with tail_slot(user_id=others[0].pk) as held:
        assert held and _follow(api, run)[0].status_code == 200
