"""Fair shares: the owners of a queue's pending outbox rows, with their operators' limits,
what counts against their limits, and the advisory locks that serialize the relays
claiming for one limited owner, each held only for a claim's short transaction
(dispatch.shares holds the policy)."""

from __future__ import annotations

from typing import NamedTuple

from .outbox import ACTIVE_RUN_TABLE, OUTBOX_TABLE, PENDING
from .sql import fetch_all

OWNER_LIMIT_TABLE = "jobs_ownerlimit"
RUN_TABLE = "jobs_run"
# jobs.models.OWNER_LIMIT_STATES: the states of a published run that count.
ACTIVE_STATES = ["queued", "running"]
# The advisory lock space of owners' limits (pg_try_advisory_xact_lock(space, key)).
LIMIT_LOCK_SPACE = 0x5EED


class PendingOwner(NamedTuple):
    """An owner with pending rows in a queue, and its operator's limit if one is set."""

    owner_id: int
    limit_set: bool  # an OwnerLimit row exists (its max_active_runs may be None: unlimited)
    max_active_runs: int | None


def owners_list_pending(*, queue: str, after: int | None, limit: int) -> list[PendingOwner]:
    """Up to `limit` owners with pending rows in the queue, in order of id after `after`
    (from the first without it), each with its OwnerLimit: one statement that skips
    through the pending index, one probe per owner, whatever the rows waiting. Takes no
    lock."""
    start = "AND owner_id > %(after)s" if after is not None else ""
    rows = fetch_all(
        f"""
        WITH RECURSIVE owners (owner_id) AS (
            (SELECT owner_id FROM {OUTBOX_TABLE}
              WHERE state = %(pending)s AND queue = %(queue)s {start}
              ORDER BY owner_id LIMIT 1)
            UNION ALL
            SELECT (SELECT o.owner_id FROM {OUTBOX_TABLE} AS o
                     WHERE o.state = %(pending)s AND o.queue = %(queue)s
                       AND o.owner_id > owners.owner_id
                     ORDER BY o.owner_id LIMIT 1)
              FROM owners WHERE owners.owner_id IS NOT NULL
        ), found AS (
            SELECT owner_id FROM owners WHERE owner_id IS NOT NULL LIMIT %(limit)s
        )
        SELECT found.owner_id, limits.owner_id IS NOT NULL, limits.max_active_runs
          FROM found LEFT JOIN {OWNER_LIMIT_TABLE} AS limits USING (owner_id)
         ORDER BY found.owner_id
        """,
        {"pending": PENDING, "queue": queue, "after": after, "limit": limit},
    )
    return [PendingOwner(*row) for row in rows]


def owner_limits_try_lock(*, owners: list[int]) -> set[int]:
    """The owners whose limit the caller's transaction now holds: a transaction-scoped
    advisory lock each (LIMIT_LOCK_SPACE, released at commit), tried without waiting. An
    owner missing from the result is being claimed for by another transaction right now."""
    if not owners:
        return set()
    rows = fetch_all(
        "SELECT owner FROM unnest(%s) AS owner "
        "WHERE pg_try_advisory_xact_lock(%s, hashtext(owner::text))",
        [owners, LIMIT_LOCK_SPACE],
    )
    return {owner for (owner,) in rows}


def owners_count_active(*, owners: list[int]) -> dict[int, int]:
    """Owner -> what counts against its limit, read in one statement (one snapshot): its
    published runs still queued or running (ActiveRun), and its rows a relay's live claim
    holds (being published now, in any queue; outbox_claimed_idx). A relay that publishes
    deletes its rows and records their ActiveRun in one transaction, so a run is counted
    once, before and after. A claim that ran out does not count: its rows are any relay's
    to take. Takes no lock."""
    if not owners:
        return {}
    rows = fetch_all(
        f"""
        SELECT owner, (SELECT count(*) FROM {ACTIVE_RUN_TABLE} AS active
                         JOIN {RUN_TABLE} AS run ON run.id = active.run_id
                        WHERE active.owner_id = owner AND run.state = ANY(%(states)s))
                    + (SELECT count(*) FROM {OUTBOX_TABLE} AS claimed
                        WHERE claimed.owner_id = owner AND claimed.state = %(pending)s
                          AND claimed.claimed_by IS NOT NULL AND claimed.claimed_until >= now())
          FROM unnest(%(owners)s::integer[]) AS owner
        """,
        {"owners": owners, "states": ACTIVE_STATES, "pending": PENDING},
    )
    return {owner: count for owner, count in rows if count}
