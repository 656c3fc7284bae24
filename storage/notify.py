"""Wake-ups through PostgreSQL's LISTEN/NOTIFY (jobs.notify sends, dispatch.wakeup listens)."""

from __future__ import annotations

from collections.abc import Iterable

from .sql import execute


def notification_send(*, channel: str, payload: str) -> None:
    """Queue a notification on `channel`, delivered when the caller's transaction commits
    (dropped on rollback; repeats of one channel and payload in a transaction fold into
    one). Takes no row lock (PostgreSQL serializes the commits that notify)."""
    execute("SELECT pg_notify(%s, %s)", [channel, payload])


def notifications_listen(*, connection, channels: Iterable[str]) -> None:
    """LISTEN on each of `channels` on `connection`: a psycopg connection of its own in
    autocommit (not Django's), which then receives their notifications. Takes no lock."""
    for channel in channels:
        connection.execute(f'LISTEN "{channel}"')
