"""storage.sql: the statements run on Django's connection, prepared or not."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from storage.sql import fetch_one


@pytest.mark.django_db(transaction=True)
def test_a_prepared_statement_replaces_a_kept_connection_that_died():
    """The first statement of a request is often a prepared one (the token's lookup): it
    health-checks a kept connection as Django's own cursor does, so a database restart
    costs a reconnection, not a failed request."""
    pid = fetch_one("SELECT pg_backend_pid()", prepared=True)[0]
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    connection.health_check_done = False  # as a new request finds it (request_started)
    assert fetch_one("SELECT pg_backend_pid()", prepared=True)[0] != pid


def test_the_database_url_sets_the_prepare_threshold_or_turns_preparing_off():
    from scheduler_project.settings.base import _database

    def threshold(query: str):
        return _database(f"postgres://u@127.0.0.1:5432/d{query}")["OPTIONS"]["prepare_threshold"]

    assert threshold("") == 5
    assert threshold("?prepare_threshold=2") == 2
    assert threshold("?prepare_threshold=none") is None
