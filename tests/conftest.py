"""Shared fixtures: users and tokens, a per-session RabbitMQ vhost, and real processes."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import uuid

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from jobs.services import job_create
from jobs.validation import JobSpecSerializer


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session", autouse=True)
def rabbitmq_vhost():
    """Every test session gets its own vhost, so runs never see each other's messages."""
    url = settings.CELERY_BROKER_URL
    vhost = settings.TEST_RABBITMQ_VHOST
    if vhost is None:
        yield url
        return
    _rabbitmqctl("add_vhost", vhost)
    _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    try:
        yield url
    finally:
        _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(scope="session", autouse=True)
def log_storage_directory():
    """Run logs' content of this session (settings.test): removed when the session ends."""
    import shutil

    yield
    shutil.rmtree(settings.STORAGES["scheduler_logs"]["OPTIONS"]["location"], ignore_errors=True)


@pytest.fixture
def user(db):
    return get_user_model().objects.create_user(f"user-{uuid.uuid4().hex[:8]}", password="pw")


@pytest.fixture
def other_user(db):
    return get_user_model().objects.create_user(f"other-{uuid.uuid4().hex[:8]}", password="pw")


@pytest.fixture
def api(user) -> APIClient:
    """An in-process API client authenticated by the user's token."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def job_spec(**overrides) -> dict:
    """A valid job body, validated as the API would, with `overrides` applied first."""
    body = {
        "name": "test job",
        "task": "tests.record",
        "schedule": {"kind": "once", "run_at": "2030-01-01T00:00:00Z"},
        **overrides,
    }
    serializer = JobSpecSerializer(data=body)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


@pytest.fixture
def make_job(user):
    """Create a job through the service layer: make_job(now=..., **body_overrides)."""

    def make(*, now: dt.datetime | None = None, owner=None, **overrides):
        return job_create(
            owner=owner or user, spec=job_spec(**overrides), now=now or dt.datetime.now(dt.UTC)
        )

    return make


# The instant in-process tests pin their clocks to (far from any real clock's reach).
PINNED_NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def queued_run(make_job):
    """make(**job_overrides): a one-time job due at PINNED_NOW, materialized by the
    scheduler: its run is queued, with its outbox row pending."""
    from dispatch.scheduler import SchedulerConfig, scheduler_run_once
    from jobs.models import Run

    def make(**overrides) -> Run:
        job = make_job(
            now=PINNED_NOW - dt.timedelta(minutes=1),
            schedule={"kind": "once", "run_at": PINNED_NOW.isoformat()},
            **overrides,
        )
        scheduler_run_once(now=PINNED_NOW, config=SchedulerConfig())
        return Run.objects.select_related("job_version").get(job=job)

    return make


def pytest_collection_modifyitems(config, items):
    # Fail loudly rather than pass with nothing collected.
    if not items and not os.environ.get("ALLOW_EMPTY"):
        raise pytest.UsageError("no tests were collected")


@pytest.fixture
def stack(transactional_db, tmp_path):
    """Real processes on the test database and a purged queue; stopped before the flush."""
    from tests.processes import Stack, purge_queue

    purge_queue()
    processes = Stack(tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()


_FIGURES: list[str] = []


@pytest.fixture
def report_figure(request):
    """Figures a test measured (lateness, counts): printed in the run's summary."""

    def report(text: str) -> None:
        _FIGURES.append(f"{request.node.nodeid}: {text}")

    return report


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("figures measured")
        for line in _FIGURES:
            terminalreporter.write_line(line)
