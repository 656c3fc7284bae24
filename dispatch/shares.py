"""Fair shares: which of a queue's pending outbox rows the relay claims in one step.

Owners with pending rows in the queue share the step's room (its batch, or what the queue's
high-water mark leaves) in turn: each gets an equal share, a share an owner cannot use
goes to the others (at most ROUNDS rounds), and the claimed rows are published
interleaved, one of each owner in turn, so one owner's flood is never ahead of another's
next run in the broker. Within an owner, rows go by priority, then oldest first.

An owner at its limit (SCHEDULER_OWNER_MAX_ACTIVE_RUNS, or an operator's OwnerLimit) has
its rows passed over, holding back no one else. What counts against the limit: the
owner's runs that a relay published while the owner was limited (ActiveRun) and that
are still `queued` (in the broker, or in a worker's prefetch) or `running`. Rows still in
the outbox, runs waiting for a retry and finished runs do not count: a run given a new
outbox row (retry, replay, republication) loses its ActiveRun row in the statement that
writes it (jobs.outbox.outbox_enqueue_runs). Relays claiming
for the same limited owner at once are serialized by a transaction-scoped advisory lock
per owner (the one that does not get it passes the owner over this step), so the limit
holds with any number of relays.

Every step's cost is bounded: owners are found by skipping through the pending index (one
probe per owner, at most MAX_OWNERS per queue), each owner's rows by one index range
(LIMIT its share), and an owner's active runs are its few ActiveRun rows, never a scan of
its pending or finished runs.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable

from django.db import connection
from django.db.models import Count

from jobs.models import OWNER_LIMIT_STATES, ActiveRun, OutboxMessage, OutboxState, OwnerLimit

# Queues one relay step (or reconciliation pass) looks at, each a question to the broker.
MAX_QUEUES = 1000
MAX_OWNERS = 1000  # owners of one queue sharing one step; the next step starts after them
ROUNDS = 3  # rounds in which an unused share goes to the other owners
# The advisory lock space of owners' limits (pg_try_advisory_xact_lock(space, key)).
LIMIT_LOCK_SPACE = 0x5EED


class OwnerTurns:
    """Where the next step of each queue starts among its owners: rotated every step, so
    that the owners who get the odd rows of a small room are not always the same."""

    def __init__(self) -> None:
        self.after: dict[str, object] = {}  # queue -> the last owner of a full owner scan
        self.turn: dict[str, int] = collections.Counter()

    def owners(self, queue: str) -> dict:
        """Owner -> its operator's limit (UNSET where none) of the owners with pending rows
        in the queue, the one whose turn it is first."""
        found = _owners_with_pending_rows(queue, after=self.after.get(queue))
        owners = list(found)
        if len(owners) >= MAX_OWNERS:
            self.after[queue] = owners[-1]
        else:
            self.after.pop(queue, None)
        self.turn[queue] += 1
        start = self.turn[queue] % len(owners) if owners else 0
        return {owner: found[owner] for owner in owners[start:] + owners[:start]}


UNSET = object()  # an owner without an operator's limit


def _owners_with_pending_rows(queue: str, *, after) -> dict:
    """Up to MAX_OWNERS owners with pending rows in the queue, in order of id after
    `after`, each with its operator's limit (UNSET where none): one statement."""
    pending = OutboxMessage.objects.filter(state=OutboxState.PENDING, queue=queue)
    if connection.vendor != "postgresql":
        if after is not None:
            pending = pending.filter(owner_id__gt=after)
        owners = pending.order_by("owner_id").values_list("owner_id", flat=True).distinct()
        owners = list(owners[:MAX_OWNERS])
        limits = OwnerLimit.objects.filter(owner_id__in=owners)
        found = dict(limits.values_list("owner_id", "max_active_runs"))
        return {owner: found.get(owner, UNSET) for owner in owners}
    table, limits = OutboxMessage._meta.db_table, OwnerLimit._meta.db_table
    start = "AND owner_id > %(after)s" if after is not None else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH RECURSIVE owners (owner_id) AS (
                (SELECT owner_id FROM {table}
                  WHERE state = %(pending)s AND queue = %(queue)s {start}
                  ORDER BY owner_id LIMIT 1)
                UNION ALL
                SELECT (SELECT o.owner_id FROM {table} AS o
                         WHERE o.state = %(pending)s AND o.queue = %(queue)s
                           AND o.owner_id > owners.owner_id
                         ORDER BY o.owner_id LIMIT 1)
                  FROM owners WHERE owners.owner_id IS NOT NULL
            ), found AS (
                SELECT owner_id FROM owners WHERE owner_id IS NOT NULL LIMIT %(limit)s
            )
            SELECT found.owner_id, limits.owner_id IS NOT NULL, limits.max_active_runs
              FROM found LEFT JOIN {limits} AS limits USING (owner_id)
             ORDER BY found.owner_id
            """,
            {"pending": OutboxState.PENDING, "queue": queue, "after": after, "limit": MAX_OWNERS},
        )
        return {owner: limit if set_ else UNSET for owner, set_, limit in cursor.fetchall()}


def owners_active(owners: Iterable) -> dict:
    """Owner -> its runs that count against its limit (published while it was limited, and
    still queued or running); the ActiveRun rows of its runs that ended are deleted first."""
    owners = list(owners)
    if not owners:
        return {}
    ActiveRun.objects.filter(owner_id__in=owners).exclude(
        run__state__in=OWNER_LIMIT_STATES
    ).delete()
    counted = ActiveRun.objects.filter(owner_id__in=owners).values_list("owner_id")
    return dict(counted.annotate(count=Count("run_id")).order_by())


def owner_at_limit(owner, *, default_limit: int | None) -> bool:
    """Whether the owner has its limit of runs in the broker or running (a read: for
    reconciliation's alarm, not for a claim)."""
    override = OwnerLimit.objects.filter(owner_id=owner).values_list("max_active_runs").first()
    limit = override[0] if override else default_limit
    if limit is None:
        return False
    active = ActiveRun.objects.filter(owner_id=owner, run__state__in=OWNER_LIMIT_STATES)
    return active.count() >= limit


def owners_locked(owners: list) -> set:
    """The owners whose limit this transaction now holds (an advisory lock each, released at
    commit); another relay holding one right now is claiming for that owner."""
    if not owners:
        return set()
    if connection.vendor != "postgresql":
        return set(owners)  # SQLite runs one writing transaction at a time
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT owner FROM unnest(%s) AS owner "
            "WHERE pg_try_advisory_xact_lock(%s, hashtext(owner::text))",
            [owners, LIMIT_LOCK_SPACE],
        )
        return {owner for (owner,) in cursor.fetchall()}


def allowances(owners: dict, *, default_limit: int | None) -> tuple[dict, set]:
    """Owner -> how many more of its runs may be published now (None: no limit), and the
    limited owners among them (whose publications are recorded as ActiveRun). `owners`:
    owner -> its operator's limit (UNSET where none: then `default_limit`,
    SCHEDULER_OWNER_MAX_ACTIVE_RUNS)."""
    limits = {owner: default_limit if limit is UNSET else limit for owner, limit in owners.items()}
    limited = [owner for owner in owners if limits[owner] is not None]
    locked = owners_locked(limited)
    active = owners_active(locked)
    allowed = {owner: None for owner in owners if limits[owner] is None}
    for owner in limited:
        allowed[owner] = max(0, limits[owner] - active.get(owner, 0)) if owner in locked else 0
    return allowed, set(limited)


def shares(room: int, owners: list, allowed: dict) -> dict:
    """Owner -> its share of `room`: equal, the remainder one each to the first owners in
    turn, never over what the owner is allowed; owners with nothing allowed get none."""
    hungry = [owner for owner in owners if allowed[owner] != 0]
    if not hungry or room <= 0:
        return {}
    share, extra = divmod(room, len(hungry))
    result = {}
    for index, owner in enumerate(hungry):
        quota = share + (index < extra)
        if allowed[owner] is not None:
            quota = min(quota, allowed[owner])
        if quota > 0:
            result[owner] = quota
    return result


def claim_shares(queue: str, *, room: int, owners: list, allowed: dict, fields: list[str]):
    """Claim up to `room` of the queue's pending rows (their `fields`, the owner's id last),
    shared among `owners` in turn, locked FOR UPDATE SKIP LOCKED; interleaved by owner."""
    allowed = dict(allowed)
    taken: dict[object, list] = {owner: [] for owner in owners}
    ids: list[int] = []
    for _ in range(ROUNDS):
        quotas = shares(room, owners, allowed)
        if not quotas:
            break
        rows = _claim(queue, quotas=quotas, exclude=ids, fields=fields)
        got = collections.Counter(row[-1] for row in rows)
        for row in rows:
            taken[row[-1]].append(row)
            ids.append(row[0])
        room -= len(rows)
        # An owner that did not fill its share has no more rows (or they are locked).
        for owner in owners:
            if got[owner] < quotas.get(owner, 0):
                allowed[owner] = 0
            elif allowed[owner] is not None:
                allowed[owner] -= got[owner]
    # Each owner's rows by priority, then oldest first; then one of each owner in turn.
    priority, row_id = fields.index("priority"), fields.index("id")
    ordered = [
        sorted(rows, key=lambda row: (-row[priority], row[row_id]))
        for rows in taken.values()
        if rows
    ]
    return [row for turn in itertools.zip_longest(*ordered) for row in turn if row is not None]


def _claim(queue: str, *, quotas: dict, exclude: list[int], fields: list[str]) -> list[tuple]:
    pending = OutboxMessage.objects.filter(state=OutboxState.PENDING, queue=queue)
    if connection.vendor != "postgresql":
        return [
            row
            for owner, quota in quotas.items()
            for row in pending.filter(owner_id=owner)
            .exclude(id__in=exclude)
            .order_by("-priority", "id")
            .values_list(*fields, "owner_id")[:quota]
        ]
    table = OutboxMessage._meta.db_table
    owner_type = OutboxMessage._meta.get_field("owner").target_field.rel_db_type(connection)
    columns = ", ".join(f"m.{field}" for field in fields)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT {columns}, m.owner_id
              FROM unnest(%(owners)s::{owner_type}[], %(quotas)s::int[]) AS share (owner, quota)
             CROSS JOIN LATERAL (
                   SELECT * FROM {table} AS pending
                    WHERE pending.state = %(pending)s AND pending.queue = %(queue)s
                      AND pending.owner_id = share.owner AND pending.id <> ALL(%(exclude)s)
                    ORDER BY pending.priority DESC, pending.id
                    LIMIT share.quota
                      FOR UPDATE SKIP LOCKED
                   ) AS m
            """,
            {"owners": list(quotas), "quotas": list(quotas.values()), "queue": queue,
             "pending": OutboxState.PENDING, "exclude": exclude},
        )  # fmt: skip
        return cursor.fetchall()
