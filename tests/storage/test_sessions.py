"""storage.sessions against PostgreSQL: a session bounded while idle inside a transaction
is ended by the server, and its locks go with it."""

from __future__ import annotations

import time

import pytest
from django.db import DatabaseError, connection, transaction

from storage.sessions import session_idle_in_transaction_timeout_set
from tests.threads import in_thread


@pytest.mark.django_db(transaction=True)
def test_a_session_idle_inside_a_transaction_past_its_bound_is_ended():
    outcome: dict[str, object] = {}

    def frozen() -> None:
        session_idle_in_transaction_timeout_set(seconds=0.3)
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
                time.sleep(1.0)  # frozen between two statements
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
        except DatabaseError as exc:
            outcome["error"] = exc
        else:
            outcome["error"] = None

    in_thread(frozen).join(10)
    assert isinstance(outcome["error"], DatabaseError)
    # The test's own session is not bounded.
    with connection.cursor() as cursor:
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        assert cursor.fetchone()[0] != "300ms"
