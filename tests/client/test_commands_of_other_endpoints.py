"""The commands written against endpoints that other parts of the API provide (bulk runs
operations, queues, calendars, occurrences), driven through click against a fake server
that answers as the API documents: their paths, bodies and output."""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

import scheduler_client.cli as cli_module
from scheduler_client import Client


@pytest.fixture
def server(monkeypatch):
    requests: list[tuple[str, str, dict | str | None]] = []
    polls = iter([{"id": "op1", "state": "running", "matched": 3, "done": 1, "refused": {}},
                  {"id": "op1", "state": "done", "matched": 3, "done": 2,
                   "refused": {"state": 1}}])  # fmt: skip

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/api/v1")
        body = request.content.decode() or None
        if body and request.headers.get("Content-Type") == "application/json":
            body = json.loads(body)
        requests.append((request.method, path + (f"?{request.url.query.decode()}"
                                                 if request.url.query else ""), body))  # fmt: skip
        assert request.method != "POST" or request.headers.get("Idempotency-Key")
        if path in ("/runs/bulk/cancel/", "/runs/bulk/replay/"):
            if body["dry_run"]:
                return httpx.Response(200, json={"matched": 3})
            return httpx.Response(202, json={"id": "op1", "state": "running", "matched": 3,
                                             "done": 0, "refused": {}})  # fmt: skip
        if path == "/operations/op1/":
            return httpx.Response(200, json=next(polls))
        queue = {"name": "jobs", "paused": False, "ready": 1, "waiting": 2, "running": 0,
                 "max_running": None, "rate_limit": None}  # fmt: skip
        if path == "/queues/":
            return httpx.Response(200, json=[queue])
        if path.startswith("/queues/jobs/"):
            return httpx.Response(200, json={**queue, **(body if isinstance(body, dict) else {})})
        if path == "/calendars/" and request.method == "GET":
            return httpx.Response(200, json={"next": None, "previous": None, "results": [
                {"id": "c1", "name": "holidays", "timezone": "Europe/Berlin",
                 "dates": ["2026-12-25"], "ranges": [], "rrules": []}]})  # fmt: skip
        if path.startswith("/calendars/"):
            return httpx.Response(201, json={"id": "c1", "name": "holidays"})
        if path == "/jobs/j1/occurrences/" and "cursor" not in request.url.params:
            return httpx.Response(200, json={"next": "http://fake/jobs/j1/occurrences/?from="
                "2026-12-20T00%3A00%3A00Z&to=2027-01-05T00%3A00%3A00Z&cursor=c2", "results": [
                {"scheduled_for": "2026-12-25T08:00:00Z", "local": "2026-12-25T09:00:00+01:00",
                 "decision": "will_skip", "run": None, "state": None,
                 "reasons": ["calendar: holidays 2026-12-25"]}]})  # fmt: skip
        if path == "/jobs/j1/occurrences/":  # the next page, by cursor
            return httpx.Response(200, json={"next": None, "results": [
                {"scheduled_for": "2026-12-28T08:00:00Z", "local": "2026-12-28T09:00:00+01:00",
                 "decision": "will_run", "run": None, "state": None, "reasons": []}]})  # fmt: skip
        return httpx.Response(404, json={"detail": "Not found."})

    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(cli_module, "Client", lambda url, token, profile=None: Client(
        "http://fake", "t", transport=transport, retries=0))  # fmt: skip
    monkeypatch.setattr(cli_module.time, "sleep", lambda seconds: None)
    return requests


def run(*args: str):
    result = CliRunner(env={"COLUMNS": "200"}).invoke(cli_module.cli, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_bulk_run_operations(server):
    dry = run("runs", "cancel", "--filter", "state=queued", "--filter", "job=j1", "--dry-run")
    assert "3 runs match" in dry.output
    expected = {"filter": {"state": "queued", "job": "j1"}, "dry_run": True}
    assert server[-1] == ("POST", "/runs/bulk/cancel/", expected)
    done = run("runs", "replay", "--filter", "state=failed", "-o", "json")
    operation = json.loads(done.stdout)
    assert operation["done"] == 2 and operation["refused"] == {"state": 1}
    assert [r[1] for r in server[-3:]] == ["/runs/bulk/replay/", "/operations/op1/",
                                          "/operations/op1/"]  # fmt: skip


def test_queues_calendars_and_occurrences(server, tmp_path):
    assert "jobs" in run("queues", "list").output
    run("queues", "pause", "jobs", "--reason", "deploy", "--until", "2026-12-05T08:00:00Z")
    assert server[-1] == ("POST", "/queues/jobs/pause/",
                          {"reason": "deploy", "until": "2026-12-05T08:00:00Z"})  # fmt: skip
    run("queues", "resume", "jobs")
    assert server[-1][:2] == ("POST", "/queues/jobs/resume/")
    run("queues", "set", "jobs", "--max-running", "10", "--rate-limit", "none")
    assert server[-1] == ("PATCH", "/queues/jobs/", {"max_running": 10, "rate_limit": None})
    assert "holidays" in run("calendars", "list").output
    (tmp_path / "cal.yaml").write_text("name: holidays\ntimezone: Europe/Berlin\n")
    (tmp_path / "h.ics").write_text("BEGIN:VCALENDAR\nEND:VCALENDAR\n")
    run("calendars", "create", "-f", str(tmp_path / "cal.yaml"))
    assert server[-1] == ("POST", "/calendars/", {"name": "holidays", "timezone": "Europe/Berlin"})
    run("calendars", "import", "c1", str(tmp_path / "h.ics"))
    assert server[-1] == ("POST", "/calendars/c1/import/", "BEGIN:VCALENDAR\nEND:VCALENDAR\n")
    shown = run("jobs", "occurrences", "j1", "--from", "2026-12-20T00:00:00Z",
                "--to", "2027-01-05T00:00:00Z")  # fmt: skip
    assert "will_skip" in shown.output and "calendar: holidays" in shown.output
    assert "will_run" in shown.output  # the second page too
    assert server[-2][1] == ("/jobs/j1/occurrences/?from=2026-12-20T00%3A00%3A00Z"
                             "&to=2027-01-05T00%3A00%3A00Z")  # fmt: skip
    assert server[-1][1].endswith("&cursor=c2")
