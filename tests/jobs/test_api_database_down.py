"""A database that refuses connections: the API answers 503 JSON with Retry-After (the
request may be retried as it is), never Django's 500 page; back up, it answers again."""

from __future__ import annotations

import contextlib
import socket

import pytest
from django.db import connection
from django.test import RequestFactory

from scheduler_project.middleware import server_error
from tests.factories import job_body

pytestmark = pytest.mark.django_db(transaction=True)


def _closed_port() -> int:
    """A loopback port that nothing listens on: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def database_refusing_connections():
    saved = dict(connection.settings_dict)
    connection.close()
    connection.settings_dict.update(HOST="127.0.0.1", PORT=str(_closed_port()))
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("get", "/api/v1/jobs/", None),
        ("post", "/api/v1/jobs/", job_body()),
        ("post", "/api/v1/jobs/bulk/", [job_body()]),
        ("get", "/api/v1/runs/", None),
    ],
)
def test_a_refused_connection_is_503_json_with_retry_after(api, method, path, body):
    assert api.get("/api/v1/jobs/").status_code == 200
    with database_refusing_connections():
        response = getattr(api, method)(path, body, format="json")
    assert response.status_code == 503
    assert response["Content-Type"] == "application/json"
    assert int(response["Retry-After"]) > 0
    assert "database is unavailable" in response.json()["detail"]
    assert api.get("/api/v1/jobs/").status_code == 200  # and it answers again


def test_the_500_handler_answers_503_for_a_database_error_outside_a_view():
    from django.db import OperationalError

    request = RequestFactory().get("/api/v1/jobs/")
    try:
        raise OperationalError("connection refused")
    except OperationalError:
        response = server_error(request)
    assert response.status_code == 503 and response["Retry-After"]
    try:
        raise ValueError("a bug")
    except ValueError:
        assert server_error(request).status_code == 500
