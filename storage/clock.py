"""The database's clock: the one every process compares leases, due times and heartbeats
with (jobs.clock)."""

from __future__ import annotations

import datetime as dt

from .sql import fetch_value


def clock_now() -> dt.datetime:
    """The database server's current time (`clock_timestamp()`: the instant of the call,
    not the transaction's start), in UTC. One round trip; in the caller's transaction or
    autocommit; takes no lock."""
    return fetch_value("SELECT clock_timestamp()").astimezone(dt.UTC)
