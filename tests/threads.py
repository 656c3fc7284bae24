"""Lining up races in tests: threads with their own database connection, and waiting until
other sessions are blocked on a lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from django.db import connection, connections


def in_thread(call: Callable[[], object], errors: list | None = None) -> threading.Thread:
    """Start `call` in a thread that closes its connection when done; with `errors`, an
    exception it raises is collected there for the test to assert on."""

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            if errors is None:
                raise
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def wait_for_lock_waiters(count: int, *, timeout: float = 20) -> None:
    """Until `count` other sessions wait on a lock (in this test's database)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connections["default"].cursor() as cursor:
            # Statistics views are a snapshot per transaction, and the caller's may be open.
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0] >= count:
                return
        time.sleep(0.02)
    raise AssertionError(f"{count} sessions never waited on a lock")
