"""Database sessions: bounds set on the calling session for its whole life."""

from __future__ import annotations

from .sql import execute


def session_idle_in_transaction_timeout_set(*, seconds: float) -> None:
    """End the calling session when it stays idle inside a transaction for `seconds` (its
    process frozen there, or stuck between two statements): PostgreSQL terminates it, which
    rolls the transaction back and releases its locks. For the session's whole life (a
    SET, not SET LOCAL); run it outside a transaction block. Takes no lock."""
    execute(
        "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
        [f"{int(seconds * 1000)}ms"],
    )
