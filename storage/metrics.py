"""The reads behind /metrics and /readyz: the tallies the triggers keep, summed over their
shards, and the database's answer to a probe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .sql import execute, fetch_all


class TallySum(NamedTuple):
    """One series of a tally (`labels` as stored, e.g. `le="0.5"` or `state="queued"`),
    its shards added up."""

    name: str
    labels: str
    count: int
    total: float


def tallies_sum(*, names: Sequence[str]) -> list[TallySum]:
    """The tallies called `names`, one row per (name, labels), their shards summed: a few
    dozen rows however many events they count (tally_unique's index). Reads in the
    caller's transaction (one snapshot for all names); takes no lock."""
    rows = fetch_all(
        'SELECT name, labels, SUM(count)::bigint, SUM(total) FROM "jobs_tally" '
        "WHERE name = ANY(%s) GROUP BY name, labels",
        [list(names)],
    )
    return [TallySum(name, labels, int(count), float(total)) for name, labels, count, total in rows]


def database_ping() -> None:
    """One round trip to the database (readiness); raises what the connection raises.
    Outside any transaction it needs; takes no lock."""
    execute("SELECT 1")
