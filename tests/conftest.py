"""Shared fixtures: users and tokens, a per-session RabbitMQ vhost, and real processes."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import uuid

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from tests import factories


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


@pytest.fixture(autouse=True)
def _packed_successes_written_by_the_worker(request, monkeypatch):
    """The lease keeper's thread writes a pack's waiting successes on its own connection,
    which cannot see the rows of a test's uncommitted transaction: outside transactional
    tests only the worker's own write (at the end of the pack) records them."""
    marker = request.node.get_closest_marker("django_db")
    transactional = "transactional_db" in request.fixturenames or (
        marker is not None and marker.kwargs.get("transaction")
    )
    if not transactional:
        import dispatch.worker.recording

        monkeypatch.setattr(dispatch.worker.recording, "SUCCESS_BATCH_SECONDS", 3600.0)


@pytest.fixture
def user(db):
    return get_user_model().objects.create_user(f"user-{uuid.uuid4().hex[:8]}", password="pw")


@pytest.fixture
def other_user(db):
    return get_user_model().objects.create_user(f"other-{uuid.uuid4().hex[:8]}", password="pw")


@pytest.fixture
def api(user) -> APIClient:
    """An in-process API client authenticated by the user's token."""
    return factories.api_client(user)


@pytest.fixture
def operator(db):
    """A user of the `operators` group (cross-owner access through the API, /metrics)."""
    return factories.operator()


@pytest.fixture
def operator_api(operator) -> APIClient:
    return factories.api_client(operator)


@pytest.fixture
def make_job(user):
    """Create a job through the service layer: make_job(now=..., **body_overrides)."""

    def make(*, now: dt.datetime | None = None, owner=None, **overrides):
        return factories.make_job(owner or user, now=now, **overrides)

    return make


@pytest.fixture
def queued_run(user):
    """make(**job_overrides): a one-time job due at PINNED_NOW, materialized by the
    scheduler: its run is queued, with its outbox row pending."""

    def make(*, owner=None, **overrides):
        return factories.queued_run(owner or user, **overrides)

    return make


def pytest_collection_modifyitems(config, items):
    # Fail loudly rather than pass with nothing collected.
    if not items and not os.environ.get("ALLOW_EMPTY"):
        raise pytest.UsageError("no tests were collected")


@pytest.fixture
def stack(transactional_db, tmp_path, request):
    """Real processes on the test database and a purged queue; stopped before the flush."""
    from jobs.lanes import lane_queues
    from tests.processes import Stack, purge_queue

    # The queue and its lanes: a backfill left draining by a test is not the next one's.
    for name in lane_queues(["jobs"]):
        purge_queue(name)
    processes = Stack(tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            # CI shows only the report: the processes' own last words go with it.
            for name in processes.processes:
                tail = processes.log(name).decode(errors="replace")[-STACK_LOG_TAIL:]
                report.sections.append((f"process {name} (log tail)", tail))


STACK_LOG_TAIL = 4000  # characters of each process's log shown with a failed test


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep the call phase's report on the item, for the stack fixture's teardown."""
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report


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
