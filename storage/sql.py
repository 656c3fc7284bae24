"""The few helpers every operation uses to run its statement on Django's connection."""

from collections.abc import Sequence
from typing import Any

from django.db import connection


def execute(statement: str, params: Sequence[Any] | dict[str, Any] = ()) -> int:
    """Run one statement; the number of rows it changed."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.rowcount


def fetch_all(statement: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall()


def fetch_one(statement: str, params: Sequence[Any] | dict[str, Any] = ()) -> tuple | None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()


def fetch_value(statement: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
    """The first column of the first row, or None when there is no row."""
    row = fetch_one(statement, params)
    return None if row is None else row[0]
