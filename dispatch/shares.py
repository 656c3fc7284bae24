"""Fair shares: which of a queue's pending outbox rows the relay claims in one step.

Owners with pending rows in the queue share the step's room (its batch, or what the queue's
high-water mark leaves) in turn: each gets an equal share, a share an owner cannot use
goes to the others (at most ROUNDS rounds), and the claimed rows are published
interleaved, one of each owner in turn, so one owner's flood is never ahead of another's
next run in the broker. Within an owner, rows go by priority, then oldest first.

An owner at its limit (SCHEDULER_OWNER_MAX_ACTIVE_RUNS, or an operator's OwnerLimit) has
its rows passed over, holding back no one else. What counts against the limit: the
owner's runs that a relay published while the owner was limited (ActiveRun) and that
are still `queued` (in the broker, or in a worker's prefetch) or `running`, and its rows
a relay's live claim holds (being published right now). Other rows still in the outbox,
rows whose claim ran out (their relay frozen or dead), runs waiting for a retry and
finished runs do not count: a run given a new outbox row (retry, replay, republication)
loses its ActiveRun row in the statement that writes it (jobs.outbox.outbox_enqueue_runs).
Relays claiming for the same limited owner at once are serialized by a
transaction-scoped advisory lock per owner (the one that does not get it passes the owner
over this step), held only for the claim's short transaction, never across the broker's
round trip: the limit holds with any number of relays, and a frozen relay holds back no
owner.

Every step's cost is bounded: owners are found by skipping through the pending index (one
probe per owner, at most MAX_OWNERS per queue), each owner's rows by one index range
(LIMIT its share), and an owner's active runs are its few ActiveRun rows, never a scan of
its pending or finished runs.
"""

from __future__ import annotations

import collections
import itertools
import uuid
from collections.abc import Iterable

from jobs.models import OWNER_LIMIT_STATES, ActiveRun, OwnerLimit
from storage.outbox import PendingMessage, outbox_claim_pending
from storage.shares import owner_limits_try_lock, owners_count_active, owners_list_pending

# Queues one relay step (or reconciliation pass) looks at, each a question to the broker.
MAX_QUEUES = 1000
MAX_OWNERS = 1000  # owners of one queue sharing one step; the next step starts after them
ROUNDS = 3  # rounds in which an unused share goes to the other owners


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
    found = owners_list_pending(queue=queue, after=after, limit=MAX_OWNERS)
    return {owner.owner_id: owner.max_active_runs if owner.limit_set else UNSET for owner in found}


def owners_active(owners: Iterable) -> dict:
    """Owner -> what counts against its limit: its runs published while it was limited and
    still queued or running, and its rows other relays are publishing right now (a live
    claim); the ActiveRun rows of its runs that ended are deleted first."""
    owners = list(owners)
    if not owners:
        return {}
    ActiveRun.objects.filter(owner_id__in=owners).exclude(
        run__state__in=OWNER_LIMIT_STATES
    ).delete()
    return owners_count_active(owners=owners)


def owner_at_limit(owner, *, default_limit: int | None) -> bool:
    """Whether the owner has its limit of runs in the broker or running (a read: for
    reconciliation's alarm, not for a claim)."""
    override = OwnerLimit.objects.filter(owner_id=owner).values_list("max_active_runs").first()
    limit = override[0] if override else default_limit
    if limit is None:
        return False
    active = ActiveRun.objects.filter(owner_id=owner, run__state__in=OWNER_LIMIT_STATES)
    return active.count() >= limit


def allowances(owners: dict, *, default_limit: int | None) -> tuple[dict, set]:
    """Owner -> how many more of its runs may be published now (None: no limit), and the
    limited owners among them (whose publications are recorded as ActiveRun). `owners`:
    owner -> its operator's limit (UNSET where none: then `default_limit`,
    SCHEDULER_OWNER_MAX_ACTIVE_RUNS)."""
    limits = {owner: default_limit if limit is UNSET else limit for owner, limit in owners.items()}
    limited = [owner for owner in owners if limits[owner] is not None]
    # Relays claiming for one owner at once: the one that does not get the lock passes it over.
    locked = owner_limits_try_lock(owners=limited)
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


def claim_shares(
    queue: str, *, room: int, owners: list, allowed: dict, claim: uuid.UUID, lease_seconds: float
) -> list[PendingMessage]:
    """Claim up to `room` of the queue's pending rows, shared among `owners` in turn,
    stamped with `claim` for `lease_seconds` (storage.outbox.outbox_claim_pending);
    interleaved by owner."""
    allowed = dict(allowed)
    taken: dict[object, list[PendingMessage]] = {owner: [] for owner in owners}
    ids: list[int] = []
    for _ in range(ROUNDS):
        quotas = shares(room, owners, allowed)
        if not quotas:
            break
        rows = outbox_claim_pending(
            queue=queue, quotas=quotas, exclude=ids, claim=claim, lease_seconds=lease_seconds
        )
        got = collections.Counter(row.owner_id for row in rows)
        for row in rows:
            taken[row.owner_id].append(row)
            ids.append(row.id)
        room -= len(rows)
        # An owner that did not fill its share has no more rows (or they are locked).
        for owner in owners:
            if got[owner] < quotas.get(owner, 0):
                allowed[owner] = 0
            elif allowed[owner] is not None:
                allowed[owner] -= got[owner]
    # Each owner's rows by priority, then oldest first; then one of each owner in turn.
    ordered = [
        sorted(rows, key=lambda row: (-row.priority, row.id)) for rows in taken.values() if rows
    ]
    return [row for turn in itertools.zip_longest(*ordered) for row in turn if row is not None]
