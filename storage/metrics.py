"""The reads behind /metrics and /readyz: the tallies the triggers keep (rolled-up rows plus
the deltas not rolled up yet), and the database's answer to a probe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .sql import execute, fetch_all


class TallySum(NamedTuple):
    """One series of a tally (`labels` as stored, e.g. `le="0.5"` or `state="queued"`),
    its rolled-up rows and pending deltas added up."""

    name: str
    labels: str
    count: int
    total: float


def tallies_sum(*, names: Sequence[str]) -> list[TallySum]:
    """The tallies called `names`, one row per (name, labels): the rolled-up rows (a few
    dozen, tally_unique's index) plus the deltas appended since the last roll-up (a scan
    of jobs_tally_delta, as long as the events of one pruner interval). One statement, so
    one snapshot: a roll-up moves deltas atomically, and a reader sees each once. Reads in
    the caller's transaction; takes no lock."""
    rows = fetch_all(
        "SELECT name, labels, SUM(count)::bigint, SUM(total) FROM ("
        ' SELECT name, labels, count, total FROM "jobs_tally" WHERE name = ANY(%s)'
        " UNION ALL"
        ' SELECT name, labels, count, total FROM "jobs_tally_delta" WHERE name = ANY(%s)'
        ") AS series GROUP BY name, labels",
        [list(names), list(names)],
    )
    return [TallySum(name, labels, int(count), float(total)) for name, labels, count, total in rows]


def database_ping() -> None:
    """One round trip to the database (readiness); raises what the connection raises.
    Outside any transaction it needs; takes no lock."""
    execute("SELECT 1")
