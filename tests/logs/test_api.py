"""GET /api/v1/runs/{id}/logs/: pages, access, attempts, completeness, live tail, text, admin."""

from __future__ import annotations

import datetime as dt
import json
import time
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.urls import reverse
from rest_framework.test import APIClient

from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from dispatch.worker import run_execute_delivery
from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.transitions import attempt_succeed
from logs_app import selectors as logs_selectors
from logs_app.store import Chunk, chunk_ship, logs_prepare, logs_seal
from tests.factories import PINNED_NOW, api_client, running_attempt
from tests.threads import in_thread

NOW = PINNED_NOW  # the clock of conftest's queued_run


def log_lines(first: int, count: int, text: str = "line", width: int = 0) -> list[dict]:
    return [
        {
            "n": n,
            "ts": (NOW + dt.timedelta(milliseconds=n)).isoformat(),
            "stream": "stdout",
            "level": "INFO",
            "text": f"{text} {n}" + "x" * width,
        }
        for n in range(first, first + count)
    ]


def encoded(lines: list[dict]) -> list[bytes]:
    return [(json.dumps(line) + "\n").encode() for line in lines]


def ship(attempt: Attempt, sequence: int, first: int, count: int, **line_options) -> None:
    chunk = Chunk(sequence, first, encoded(log_lines(first, count, **line_options)))
    assert chunk_ship(attempt=attempt, chunk=chunk, now=NOW)


def succeed(attempt: Attempt, last_chunks: list[Chunk] = ()) -> None:
    """End the attempt as its worker does: outcome and manifest in one transaction."""
    with transaction.atomic():
        assert attempt_succeed(attempt=attempt, now=NOW)
        placed = logs_prepare(attempt=attempt, chunks=list(last_chunks))
        logs_seal(attempt=attempt, placed=placed, dropped_lines=0, now=NOW)


def logs_url(run_id) -> str:
    return reverse("run-logs", args=[run_id])


@pytest.mark.django_db(transaction=True)
def test_ten_thousand_lines_page_by_page_in_order_and_complete(api, queued_run, monkeypatch):
    run = queued_run()

    def handler(ctx):
        for index in range(10_000):
            print(f"line {index}")

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m")
    chunks_read = []
    read = logs_selectors.chunk_lines
    monkeypatch.setattr(
        logs_selectors, "chunk_lines", lambda chunk: chunks_read.append(1) or read(chunk)
    )

    seen, pages = [], 0
    url = logs_url(run.id) + "?page_size=700"
    while url:
        chunks_read.clear()
        body = api.get(url).json()
        pages += 1
        assert body["complete"] is True
        assert body["attempt"] == 1 and body["attempt_state"] == "succeeded"
        assert len(body["lines"]) <= 700
        # Only the chunks that hold the page (and the line after it), never all of them.
        assert len(chunks_read) <= 3
        seen += [line["n"] for line in body["lines"]]
        url = body["next"]
        if url is None:
            assert body["ended"] is True
    assert seen == list(range(10_000))
    assert pages == 15  # 14 full pages and one of 200
    assert body["attempts"] == [
        {"number": 1, "state": "succeeded", "complete": True, "line_count": 10_000}
    ]


@pytest.mark.django_db
def test_page_size_is_bounded_and_after_is_a_cursor(api, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 10)
    body = api.get(logs_url(attempt.run_id), {"after": 6}).json()
    assert [line["n"] for line in body["lines"]] == [7, 8, 9]
    assert api.get(logs_url(attempt.run_id), {"page_size": 5001}).status_code == 400
    assert api.get(logs_url(attempt.run_id), {"page_size": 0}).status_code == 400


@pytest.mark.django_db
def test_only_the_owner_operators_and_superusers_see_the_logs(queued_run, other_user):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 3)
    url = logs_url(attempt.run_id)
    owner = attempt.run.job.owner

    assert api_client(owner).get(url).status_code == 200
    stranger = api_client(other_user)
    assert stranger.get(url).status_code == 404
    assert stranger.get(url, {"attempt": 1}).status_code == 404
    assert stranger.get(url, {"format": "text"}).status_code == 404
    assert APIClient().get(url).status_code == 401

    other_user.groups.add(Group.objects.get_or_create(name="operators")[0])
    assert [line["n"] for line in stranger.get(url).json()["lines"]] == [0, 1, 2]
    # is_staff alone opens the admin, not other owners' logs (docs/security.md).
    staff = get_user_model().objects.create_user("staff-logs", is_staff=True)
    assert api_client(staff).get(url).status_code == 404
    root = get_user_model().objects.create_superuser("root-logs", "r@example.com", "pw")
    assert api_client(root).get(url).status_code == 200


@pytest.mark.django_db
def test_an_attempt_the_run_does_not_have_is_404(api, queued_run):
    run = queued_run()
    assert api.get(logs_url(run.id)).status_code == 404  # no attempt yet
    attempt = running_attempt(queued_run)
    assert api.get(logs_url(attempt.run_id), {"attempt": 2}).status_code == 404
    assert api.get(logs_url(attempt.run_id), {"attempt": 1}).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_each_attempt_has_its_own_log(api, queued_run):
    run = queued_run(retry={"max_attempts": 2, "initial_delay_seconds": 0})
    calls = []

    def handler(ctx):
        calls.append(ctx.attempt)
        print(f"attempt {ctx.attempt} starts")
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")
        print("and succeeds")

    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m1")
    assert Run.objects.get(id=run.id).state == RunState.RETRY_WAIT
    scheduler_run_once(now=NOW + dt.timedelta(days=1), config=SchedulerConfig())
    run_execute_delivery(run_id=str(run.id), handler=handler, worker="w", message_id="m2")
    assert calls == [1, 2]

    latest = api.get(logs_url(run.id)).json()
    assert latest["attempt"] == 2 and latest["complete"] is True
    assert [line["text"] for line in latest["lines"]] == ["attempt 2 starts", "and succeeds"]
    assert latest["attempts"] == [
        {"number": 1, "state": "failed", "complete": True, "line_count": 1},
        {"number": 2, "state": "succeeded", "complete": True, "line_count": 2},
    ]
    first = api.get(logs_url(run.id), {"attempt": 1}).json()
    assert [line["text"] for line in first["lines"]] == ["attempt 1 starts"]
    assert first["fencing_token"] < latest["fencing_token"]


@pytest.mark.django_db
def test_a_lost_attempt_shows_what_it_shipped_as_incomplete(api, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 4)
    Attempt.objects.filter(id=attempt.id).update(state=AttemptState.LOST, finished_at=NOW)
    # A stale worker can add nothing once the attempt is lost.
    assert not chunk_ship(attempt=attempt, chunk=Chunk(1, 4, encoded(log_lines(4, 1))), now=NOW)

    body = api.get(logs_url(attempt.run_id)).json()
    assert body["attempt_state"] == "lost"
    assert body["complete"] is False
    assert [line["n"] for line in body["lines"]] == [0, 1, 2, 3]
    assert body["ended"] is True and body["next"] is None
    assert body["attempts"] == [{"number": 1, "state": "lost", "complete": False, "line_count": 4}]


@pytest.mark.django_db
def test_a_running_attempt_gives_a_next_to_poll(api, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 3)
    body = api.get(logs_url(attempt.run_id)).json()
    assert body["ended"] is False and body["complete"] is False
    query = parse_qs(urlsplit(body["next"]).query)
    assert query["after"] == ["2"] and query["attempt"] == ["1"]
    again = api.get(body["next"]).json()  # nothing new yet: the same position again
    assert again["lines"] == [] and again["next"] == body["next"]


@pytest.mark.django_db(transaction=True)
def test_follow_returns_new_lines_as_they_ship_and_ends_with_the_attempt(api, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 2)
    first = api.get(logs_url(attempt.run_id)).json()
    assert [line["n"] for line in first["lines"]] == [0, 1]
    shipped_at = []

    def ship_later():
        time.sleep(1.0)
        ship(attempt, 1, 2, 3)
        shipped_at.append(time.monotonic())

    thread = in_thread(ship_later)
    body = api.get(first["next"] + "&follow=true&wait=10").json()
    answered_at = time.monotonic()
    thread.join()
    assert [line["n"] for line in body["lines"]] == [2, 3, 4]
    assert answered_at - shipped_at[0] < 2.0
    assert body["ended"] is False
    assert parse_qs(urlsplit(body["next"]).query)["follow"] == ["true"]

    def end_later():
        time.sleep(1.0)
        succeed(attempt, [Chunk(2, 5, encoded(log_lines(5, 1, text="last")))])

    thread = in_thread(end_later)
    started = time.monotonic()
    final = api.get(body["next"]).json()  # `next` keeps follow and wait
    thread.join()
    assert time.monotonic() - started < 5
    assert [line["text"] for line in final["lines"]] == ["last 5"]
    assert final["ended"] is True and final["next"] is None and final["complete"] is True


@pytest.mark.django_db(transaction=True)
def test_follow_gives_up_after_the_wait_with_no_lines(api, queued_run):
    attempt = running_attempt(queued_run)
    started = time.monotonic()
    body = api.get(logs_url(attempt.run_id), {"follow": "true", "wait": 1}).json()
    assert 0.7 < time.monotonic() - started < 3
    assert body["lines"] == [] and body["ended"] is False and body["next"]


@pytest.mark.django_db
def test_text_download_streams_one_line_per_log_line(api, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 2)
    succeed(attempt, [Chunk(1, 2, encoded(log_lines(2, 1, text="end")))])
    for response in (
        api.get(logs_url(attempt.run_id), {"format": "text"}),
        api.get(logs_url(attempt.run_id), HTTP_ACCEPT="text/plain"),
    ):
        assert response.status_code == 200
        assert response.streaming
        assert response["Content-Type"].startswith("text/plain")
        text = b"".join(response.streaming_content).decode()
        assert text.splitlines() == [
            f"{line['ts']} stdout INFO {line['text']}"
            for line in log_lines(0, 2) + log_lines(2, 1, text="end")
        ]
    assert api.get(logs_url(attempt.run_id), {"format": "text", "attempt": 9}).status_code == 404


@pytest.mark.django_db
def test_the_admin_shows_an_attempts_log_to_staff(client, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 3, text="admin sees")
    staff = get_user_model().objects.create_superuser("admin-logs", password="pw")
    client.force_login(staff)
    page = client.get(reverse("admin:logs_app_attempt_log", args=[attempt.id]))
    assert page.status_code == 200
    assert "admin sees 2" in page.content.decode()
    run_page = client.get(reverse("admin:jobs_run_change", args=[attempt.run_id]))
    assert reverse("admin:logs_app_attempt_log", args=[attempt.id]) in run_page.content.decode()
    assert client.get(reverse("admin:logs_app_logchunk_changelist")).status_code == 200
    succeed(attempt)
    assert client.get(reverse("admin:logs_app_logmanifest_changelist")).status_code == 200

    client.force_login(get_user_model().objects.create_user("not-staff", password="pw"))
    page = client.get(reverse("admin:logs_app_attempt_log", args=[attempt.id]))
    assert page.status_code == 302  # to the admin's login


@pytest.mark.django_db(transaction=True)
def test_a_cursor_past_the_end_and_a_missing_attempt(api, queued_run):
    attempt = running_attempt(queued_run)
    ship(attempt, 0, 0, 3)
    succeed(attempt)
    r = api.get(logs_url(attempt.run_id), {"after": 2**31 - 1, "page_size": 5000})
    assert r.status_code == 200, r.content[:300]
    r = api.get(logs_url(attempt.run_id), {"format": "text", "attempt": 9})
    assert r.status_code == 404
