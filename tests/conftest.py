"""Shared fixtures: users and tokens, a per-session RabbitMQ vhost (or the embedded
PostgreSQL and skipped RabbitMQ tests where those services are missing: settings.test), and
real processes."""

from __future__ import annotations

import datetime as dt
import inspect
import os
import shutil
import subprocess
import uuid

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from tests import factories


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


# Where RabbitMQ does not answer (and CI is not set), the tests that use it are skipped
# with the command that installs it: those that start real processes (`stack`), and those
# whose body, or one of whose fixtures, reaches the broker.
RABBITMQ_WORDS = ("purge_queue", "kombu", "rabbitmq", "Stack(", "CELERY_BROKER_URL")
RABBITMQ_FOLDERS = ("faults", "browser")  # every one of them runs the whole pipeline
RABBITMQ_MISSING = (
    "RabbitMQ does not answer on 127.0.0.1:5672: install and start it "
    "(`sudo apt-get install rabbitmq-server`, or `brew install rabbitmq && brew services "
    "start rabbitmq`; bin/check-services says more), or set CELERY_BROKER_URL"
)


def _needs_rabbitmq(item) -> bool:
    if "stack" in getattr(item, "fixturenames", ()):
        return True
    if any(folder in item.path.parts for folder in RABBITMQ_FOLDERS):
        return True
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for name, definitions in info.name2fixturedefs.items() if info is not None else ():
        if name != "rabbitmq_vhost":  # every test's, and harmless without RabbitMQ
            functions += [definition.func for definition in definitions]
    for function in functions:
        try:
            source = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            continue
        if any(word in source for word in RABBITMQ_WORDS):
            return True
    return False


@pytest.fixture(scope="session", autouse=True)
def embedded_postgres():
    """The embedded PostgreSQL of this session (settings.test, when no server answers):
    started by the first connection, stopped and removed when the session ends (after
    pytest-django dropped the test database); servers of killed sessions are removed too."""
    if not settings.TEST_EMBEDDED_POSTGRES:
        yield None
        return
    from django.db import connection

    server = connection.embedded_server
    for data_dir in server.data_dir.parent.glob("test-postgres-*"):
        pid = data_dir.name.rsplit("-", 1)[-1]
        if data_dir != server.data_dir and pid.isdigit() and not _alive(int(pid)):
            _remove(type(server)(data_dir))
    try:
        yield server
    finally:
        connection.close()
        _remove(server)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove(server) -> None:
    server.stop()
    shutil.rmtree(server.data_dir, ignore_errors=True)
    server.lock_path.unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def rabbitmq_vhost():
    """Every test session gets its own vhost, so runs never see each other's messages."""
    url = settings.CELERY_BROKER_URL
    vhost = settings.TEST_RABBITMQ_VHOST
    if vhost is None or settings.TEST_RABBITMQ_MISSING:
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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Drills (the fault injections, machines lost, long races) take minutes together: they
    # run only when asked for by marker (`bin/test -m drill`, CI's second step), so the
    # suite stays short. Every fault test is a drill.
    for item in items:
        if item.get_closest_marker("faults") and not item.get_closest_marker("drill"):
            item.add_marker(pytest.mark.drill)
    if "drill" not in (config.option.markexpr or ""):
        drills = [item for item in items if item.get_closest_marker("drill")]
        if drills:
            config.hook.pytest_deselected(items=drills)
            items[:] = [item for item in items if not item.get_closest_marker("drill")]
    # Fail loudly rather than pass with nothing collected.
    if not items and not os.environ.get("ALLOW_EMPTY"):
        raise pytest.UsageError("no tests were collected")
    if settings.TEST_RABBITMQ_MISSING:
        skip = pytest.mark.skip(reason=RABBITMQ_MISSING)
        for item in items:
            if _needs_rabbitmq(item):
                item.add_marker(skip)


def pytest_report_header(config):
    if settings.TEST_EMBEDDED_POSTGRES:
        return [
            "database: the embedded PostgreSQL (nothing answers at DATABASE_URL; CI=true "
            "fails instead)"
        ]
    return []


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
