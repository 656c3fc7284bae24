"""The server's own catalog: what the embedded PostgreSQL needs before Django connects."""

from __future__ import annotations

from typing import Any


def database_create_if_missing(*, connection: Any, name: str) -> bool:
    """Create database `name` unless it exists; True when this call created it. Runs on a
    psycopg connection to another database of the server, in autocommit (CREATE DATABASE
    cannot run in a transaction). Two callers at once: the loser's CREATE fails with
    DuplicateDatabase (the embedded server's start lock keeps them apart)."""
    if connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
        return False
    escaped = name.replace('"', '""')
    connection.execute(f'CREATE DATABASE "{escaped}"')
    return True
