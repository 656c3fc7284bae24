"""Queue controls in dispatch (jobs.queues says what each control means): the worker's gate
at a claim, and how much of a queue a relay may publish in one step.

At a claim: the queue row is locked (FOR SHARE; FOR UPDATE when capped) in the claim's
transaction, so a pause waits for the claims in flight and every claim after it sees it;
a run of a paused queue, or of one at its cap, is handed back (jobs.queues.run_hand_back).

At a relay step: a paused queue (its lanes too) is passed over; a capped queue publishes
no more than its cap leaves (runs running, or published and not yet claimed, another
relay's claimed rows included); a rate-limited one at most two bursts in the broker. The
room is counted under the queue's room lock in the claim's transaction: relays claiming
the same queue at once take turns, and the second counts what the first claimed.
A rate is kept at the claim: each start takes a token from the bucket in the queue's row,
in the claim's transaction; a worker without a token waits until one is due (the bucket
says when) and tries again, so starts never pass the rate plus one burst, across every
worker; the relays keep at most two bursts of the queue in the broker meanwhile.
The controls are read once per step, so a pause reaches every relay within its poll
interval (at most a second); the workers' gate reads it at every claim.
"""

from __future__ import annotations

import math

from django.db import transaction

from jobs.clock import db_now
from jobs.counters import counter_increment
from jobs.lanes import LANE_SUFFIXES
from jobs.queues import run_hand_back
from storage.queues import (
    QueueHold,
    queue_room_lock_counts,
    queue_running_count,
    queue_token_take,
    queues_held,
    run_gate_lock,
)


def queue_holds_run(*, run_id: str) -> float | bool:
    """In the claim's transaction, before the claim: True when the run's queue holds it
    back (paused, or at its cap), and it was handed back to wait in PostgreSQL; for a
    rate-limited queue without a token now, the seconds until one (nothing done: the
    caller waits and tries again); False: claim it (its token taken). The queue row stays
    locked until the claim's transaction ends."""
    gate = run_gate_lock(run_id=run_id)
    if gate is None:
        return False
    full = gate.max_running is not None and (
        queue_running_count(queue=gate.queue) >= gate.max_running
    )
    if gate.paused or full:
        if run_hand_back(run_id=run_id, now=db_now()):
            reason = "paused" if gate.paused else "max_running"
            counter_increment("scheduler_runs_handed_back_total",
                              labels=f'queue="{gate.queue}",reason="{reason}"')  # fmt: skip
        return True
    if gate.rate_limited:
        wait = queue_token_take(queue=gate.queue)
        return wait if wait > 0 else False
    return False


def queue_hand_back(*, run_id: str) -> bool:
    """Hand the delivered run back to wait in PostgreSQL (its own transaction)."""
    with transaction.atomic():
        return run_hand_back(run_id=run_id, now=db_now())


def queue_of_lane(name: str) -> str:
    """The configured queue a Celery queue belongs to (a lane's, or itself)."""
    for lane in LANE_SUFFIXES:
        if name.endswith(f".{lane}"):
            return name[: -len(lane) - 1]
    return name


class QueueRoom:
    """The controls of one relay step, read once: what each queue may publish."""

    def __init__(self) -> None:
        self.held: dict[str, QueueHold] = queues_held()

    def paused(self, name: str) -> bool:
        """Whether the Celery queue `name`'s queue is paused (nothing of it is published)."""
        hold = self.held.get(queue_of_lane(name))
        return hold is not None and hold.paused

    def room(self, name: str) -> float:
        """How many of the Celery queue `name`'s rows may be published this step, before
        its rate (the tokens are taken separately): 0 when its queue is paused. For a capped
        or rate-limited queue, in the caller's transaction (the relay's claim): the queue's
        room lock is taken and held until it ends, so that two relays never both fill the
        same room, and the runs another relay is publishing count as published."""
        hold = self.held.get(queue_of_lane(name))
        if hold is None:
            return math.inf
        if hold.paused:
            return 0
        if hold.max_running is None and hold.burst is None:
            return math.inf
        running, published = queue_room_lock_counts(queue=hold.name)
        room = math.inf
        if hold.max_running is not None:
            room = max(0, hold.max_running - running - published)
        if hold.burst is not None:
            # A rate is kept at the claim (its token); the broker holds at most two bursts
            # of the queue meanwhile, so a resume or a new rate finds little to hand back.
            room = min(room, max(0, math.ceil(2 * hold.burst) - published))
        return room
