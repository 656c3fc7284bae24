"""The few helpers every operation uses to run its statement on Django's connection."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import psycopg
from django.db import connection


def _cursor(prepared: bool):
    """Django's cursor, or with `prepared` a statement prepared once per connection
    (`prepared_cursor`): for a statement run on every request or every run, whose parse
    and plan cost the database more than its execution."""
    return prepared_cursor() if prepared else connection.cursor()


def execute(
    statement: str, params: Sequence[Any] | dict[str, Any] = (), *, prepared: bool = False
) -> int:
    """Run one statement; the number of rows it changed."""
    with _cursor(prepared) as cursor:
        cursor.execute(statement, params)
        return cursor.rowcount


def fetch_all(
    statement: str, params: Sequence[Any] | dict[str, Any] = (), *, prepared: bool = False
) -> list[tuple]:
    with _cursor(prepared) as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall()


def fetch_one(
    statement: str, params: Sequence[Any] | dict[str, Any] = (), *, prepared: bool = False
) -> tuple | None:
    with _cursor(prepared) as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()


def fetch_value(statement: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
    """The first column of the first row, or None when there is no row."""
    row = fetch_one(statement, params)
    return None if row is None else row[0]


class _PreparedCursor(psycopg.Cursor):
    """Server-side binding, each statement prepared on its connection at its first
    execution (psycopg names and keeps it; `prepare_threshold` in the database's OPTIONS
    must not be None, or nothing is prepared)."""

    def execute(self, query, params=None, *, prepare=True, binary=None):
        super().execute(query, params, prepare=prepare, binary=binary)
        if self._query is None:
            # A prepared execution sends no text: what Django's query log shows instead.
            self._query = _Shown(query.encode() if isinstance(query, str) else query)
        return self


class _Shown(NamedTuple):
    query: bytes
    params: None = None


@contextmanager
def prepared_cursor() -> Iterator[Any]:
    """A cursor for the hot statements: prepared once per connection (parsed and
    planned once, then bound and executed), through Django's wrapper (its errors, its
    query log). Django's own cursors bind on the client and prepare nothing. A statement
    run here casts every parameter whose type PostgreSQL cannot infer (server-side
    binding sends no literal)."""
    with connection.wrap_database_errors:
        # As Django's own cursor(): a kept connection that died (a database restart, a
        # failover) is replaced at the first statement of a request, not failed.
        connection.close_if_health_check_failed()
        connection.ensure_connection()
    cursor = connection._prepare_cursor(_PreparedCursor(connection.connection))
    with cursor:
        yield cursor
