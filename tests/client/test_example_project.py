"""examples/schedctl works as its README says: its tasks register, its jobs file is valid
for the server, and its beat schedule imports (naming the task that is not a job task)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jobs.api.validation import JobSpecSerializer
from scheduler_client.apply import jobs_file_read, managed
from scheduler_client.beat import beat_import

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "schedctl"


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    for name in ("myteam", "myteam.tasks", "celeryconfig_beat"):
        sys.modules.pop(name, None)


def test_the_example_jobs_file_is_valid_with_its_tasks(db, example_on_path):
    import myteam.tasks  # noqa: F401 - registers the example's job tasks

    bodies = jobs_file_read(str(EXAMPLE / "jobs.yaml"))
    assert [body["name"] for body in bodies] == ["morning report", "nightly cleanup", "ping"]
    for body in bodies:
        serializer = JobSpecSerializer(data=managed(body))
        assert serializer.is_valid(), (body["name"], serializer.errors)


def test_the_example_beat_schedule_imports(example_on_path):
    import celeryconfig_beat

    result = beat_import(celeryconfig_beat.app)
    by_name = {body["name"]: body for body in result.jobs}
    assert by_name["morning report"]["schedule"] == {
        "kind": "cron",
        "expression": "0 9 * * MON-FRI",
        "timezone": "Europe/Berlin",
    }
    assert by_name["ping"]["schedule"] == {"kind": "interval", "every_seconds": 60}
    # Offline, the unknown task is carried; `schedctl import-beat` asks the server and names it.
    assert "legacy export" in by_name
