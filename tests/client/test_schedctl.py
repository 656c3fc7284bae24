"""`schedctl`, the installed console script, in a subprocess against a live server: every
command, `-o json` parsed, the API's message and a non-zero exit on failure, a backfill's
progress, and the client library without Django."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from jobs.models import Job, JobState, Run, RunState
from scheduler_client.cli import cli
from tests.factories import owner, token_for

from .helpers import SCHEDCTL, ok, schedctl


@pytest.fixture
def ctl(live_server, transactional_db):
    token = token_for(owner("schedctl"))

    def run(*args: str, token: str | None = token, **kwargs):
        return schedctl(*args, url=live_server.url, token=token, **kwargs)

    return run


def test_every_job_and_run_command(ctl):
    created = ok(ctl("jobs", "create", "--name", "hourly", "--task", "tests.record",
                     "--cron", "0 * * * *", "--timezone", "Europe/Berlin",
                     "--kwargs", '{"n": 1}', "-o", "json")).json()  # fmt: skip
    job_id = created["id"]
    assert created["schedule"] == {"kind": "cron", "expression": "0 * * * *",
                                   "timezone": "Europe/Berlin"}  # fmt: skip
    assert created["kwargs"] == {"n": 1} and created["version"] == 1

    listed = ok(ctl("jobs", "list", "-o", "json")).json()
    assert [job["id"] for job in listed] == [job_id]
    table = ok(ctl("jobs", "list")).stdout
    assert "hourly" in table and "cron 0 * * * * Europe/Berlin" in table
    assert ok(ctl("jobs", "get", job_id, "-o", "json")).json()["name"] == "hourly"
    assert "tests.record" in ok(ctl("jobs", "get", job_id)).stdout

    assert ok(ctl("jobs", "pause", job_id, "-o", "json")).json()["state"] == "paused"
    assert ok(ctl("jobs", "resume", job_id)).stdout.strip().endswith("active, version 1")

    run = ok(ctl("jobs", "trigger", job_id, "-o", "json")).json()
    assert run["kind"] == "manual" and run["state"] == "queued"
    runs = ok(ctl("runs", "list", "--job", job_id, "-o", "json")).json()
    assert [r["id"] for r in runs] == [run["id"]]
    assert ok(ctl("runs", "get", run["id"], "-o", "json")).json()["id"] == run["id"]
    assert run["id"] in ok(ctl("runs", "list", "--state", "queued")).stdout
    assert ok(ctl("runs", "cancel", run["id"], "-o", "json")).json()["state"] == "cancelled"
    assert ok(ctl("runs", "replay", run["id"], "-o", "json")).json()["state"] == "queued"
    assert Run.objects.get(id=run["id"]).state == RunState.QUEUED

    history = ok(ctl("jobs", "history", job_id, "-o", "json")).json()
    actions = [event["action"] for event in history["events"]]
    assert {"job.created", "job.paused", "job.resumed"} <= set(actions), actions
    assert "job.paused" in ok(ctl("jobs", "history", job_id)).stdout

    preview = ok(ctl("schedules", "preview", "--cron", "30 2 * * *", "--timezone",
                     "America/New_York", "--after", "2025-03-08T00:00:00Z", "--count", "3",
                     "-o", "json")).json()  # fmt: skip
    assert [o["at"] for o in preview] == ["2025-03-08T07:30:00Z", "2025-03-09T07:00:00Z",
                                          "2025-03-10T06:30:00Z"]  # fmt: skip
    assert preview[1]["dst"] == "gap_shifted"

    assert ok(ctl("jobs", "cancel", job_id, "-o", "json")).json()["state"] == "cancelled"
    assert Job.objects.get(id=job_id).state == JobState.CANCELLED


def test_failures_exit_non_zero_with_the_apis_message(ctl):
    missing = ctl("jobs", "get", "00000000-0000-0000-0000-000000000000")
    assert missing.code == 1 and "404" in missing.stderr and "Not found" in missing.stderr
    bad = ctl("jobs", "create", "--name", "x", "--task", "tests.record", "--cron", "61 * * * *")
    assert bad.code == 1 and "400" in bad.stderr and "schedule" in bad.stderr, bad.stderr
    unknown = ctl("jobs", "create", "--name", "x", "--task", "no.such.task", "--every", "60")
    assert unknown.code == 1 and "task" in unknown.stderr
    assert not Job.objects.exists()  # nothing half-written

    job_id = ok(ctl("jobs", "create", "--name", "x", "--task", "tests.record", "--every", "60",
                    "-o", "json")).json()["id"]  # fmt: skip
    ok(ctl("jobs", "pause", job_id))
    again = ctl("jobs", "pause", job_id)
    assert again.code == 1 and "409" in again.stderr and "paused" in again.stderr
    anonymous = ctl("jobs", "list", token=None)
    assert anonymous.code == 1 and "401" in anonymous.stderr
    forged = ctl("jobs", "list", token="not-a-token")
    assert forged.code == 1 and "401" in forged.stderr
    usage = ctl("runs", "cancel")  # neither a run nor --filter
    assert usage.code == 2 and "--filter" in usage.stderr
    unreachable = schedctl("jobs", "list", url="http://127.0.0.1:9", token="t",
                           env={"SCHEDULER_RETRIES": "0"})  # fmt: skip
    assert unreachable.code == 1 and "cannot reach the server" in unreachable.stderr

    # Queues are for operators: a plain user's token gets the API's refusal and exit 1.
    queues = ctl("queues", "list")
    assert queues.code == 1 and queues.stderr.startswith("Error: 403"), queues
    occurrences = ctl("jobs", "occurrences", job_id, "--from", "2026-01-01T00:00:00Z",
                      "--to", "2026-01-02T00:00:00Z", "-o", "json")  # fmt: skip
    assert occurrences.code == 0, occurrences
    dry = ctl("runs", "cancel", "--filter", "state=queued", "--dry-run", "-o", "json")
    assert dry.code == 0 and "matched" in json.loads(dry.stdout), dry


def test_a_backfill_shows_its_progress_and_is_idempotent(ctl):
    job_id = ok(ctl("jobs", "create", "--name", "hourly", "--task", "tests.record",
                    "--cron", "0 * * * *", "-o", "json")).json()["id"]  # fmt: skip
    args = ("jobs", "backfill", job_id, "--start", "2026-01-01T00:00:00Z",
            "--end", "2026-01-04T00:00:00Z", "--step", "86400")  # fmt: skip
    first = ok(ctl(*args, "-o", "json"))
    assert len(first.json()["created"]) == 72 and first.json()["existing"] == []
    assert "backfill" in first.stderr and "100%" in first.stderr and "72 runs" in first.stderr
    # Slices over 1,000 occurrences are halved until they fit: a minutely job's 2 days.
    minutely = ok(ctl("jobs", "create", "--name", "minutely", "--task", "tests.record",
                      "--cron", "* * * * *", "-o", "json")).json()["id"]  # fmt: skip
    wide = ok(ctl("jobs", "backfill", minutely, "--start", "2026-01-01T00:00:00Z",
                  "--end", "2026-01-02T00:00:00Z", "--step", "86400", "-o", "json"))  # fmt: skip
    assert len(wide.json()["created"]) == 1440
    again = ok(ctl(*args))
    assert "0 runs created, 72 existing" in again.stdout
    assert Run.objects.filter(job_id=job_id, kind="backfill").count() == 72


def test_every_command_has_help_with_an_example():
    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    commands = list(walk(cli, []))
    assert len(commands) >= 30
    for path, command in commands:
        text = command.get_help(click.Context(command, info_name=" ".join(["schedctl", *path])))
        assert "Example" in text, path
    # Through the installed script too, and shell completion from click.
    done = subprocess.run([SCHEDCTL, "runs", "logs", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--follow" in done.stdout and "Example" in done.stdout
    done = subprocess.run([SCHEDCTL, "completion", "bash"], capture_output=True, text=True)
    assert done.returncode == 0 and "_SCHEDCTL_COMPLETE" in done.stdout


def test_the_client_imports_no_django():
    code = ("import sys, scheduler_client, scheduler_client.cli, scheduler_client.apply, "
            "scheduler_client.beat; print(sorted(m for m in sys.modules if m.startswith("
            "('django', 'rest_framework', 'jobs', 'dispatch'))))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_retries_keep_the_idempotency_key_and_honour_retry_after(monkeypatch):
    import httpx

    from scheduler_client import ApiError, Client

    seen, slept = [], []
    answers = iter([
        httpx.Response(429, headers={"Retry-After": "3"}, json={"detail": "slow down"}),
        httpx.Response(503, json={"detail": "The database is unavailable"}),
        httpx.ConnectError("refused"),
        httpx.Response(201, json={"id": "1", "name": "n", "state": "active", "version": 1}),
    ])  # fmt: skip

    def handler(request):
        seen.append(request.headers.get("Idempotency-Key"))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr("scheduler_client.client.time.sleep", slept.append)
    client = Client("http://server", "t", transport=httpx.MockTransport(handler), retries=5)
    job = client.job_create({"name": "n"})
    assert job.id == "1" and job.version == 1
    assert len(seen) == 4 and len(set(seen)) == 1 and seen[0]
    assert slept[0] >= 3  # Retry-After honoured
    assert slept[1] < slept[2] * 4 + 1  # then backoff, bounded
    # Out of retries: the API's message.
    refusing = Client("http://server", "t", retries=1, transport=httpx.MockTransport(
        lambda request: httpx.Response(503, json={"detail": "down"})))  # fmt: skip
    with pytest.raises(ApiError, match="503: down"):
        refusing.jobs().__next__()


def test_a_pause_whose_answer_was_lost_is_not_reported_as_refused():
    import httpx

    from scheduler_client import Client

    calls = []

    def handler(request):
        calls.append(request.method)
        if len(calls) == 1:
            raise httpx.ReadError("connection dropped after the server paused it")
        if request.method == "POST":
            return httpx.Response(409, json={"detail": "already paused", "state": "paused"})
        return httpx.Response(200, json={"id": "j", "state": "paused", "version": 1})

    client = Client("http://server", "t", transport=httpx.MockTransport(handler), backoff=0)
    assert client.job_pause("j").state == "paused"
    assert calls == ["POST", "POST", "GET"]


def test_server_and_token_from_a_profile(tmp_path, monkeypatch):
    from scheduler_client.config import settings_load

    config = tmp_path / "config.toml"
    config.write_text('default = "prod"\n[profiles.prod]\nurl = "https://prod"\ntoken = "p"\n'
                      '[profiles.dev]\nurl = "http://dev"\ntoken = "d"\nretries = 2\n')  # fmt: skip
    for name in ("SCHEDULER_URL", "SCHEDULER_TOKEN", "SCHEDULER_PROFILE", "SCHEDULER_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SCHEDULER_CONFIG", str(config))
    assert settings_load().url == "https://prod" and settings_load().token == "p"
    assert settings_load(profile="dev").retries == 2
    monkeypatch.setenv("SCHEDULER_TOKEN", "from-env")  # the environment wins
    assert settings_load(profile="dev").token == "from-env"
    with pytest.raises(ValueError, match="no profile 'nope'"):
        settings_load(profile="nope")
