"""Queue controls in dispatch (jobs.queues says what each control means): the worker's gate
at a claim, and how much of a queue a relay may publish in one step.

At a claim: the queue row is locked (FOR SHARE; FOR UPDATE when capped) in the claim's
transaction, so a pause waits for the claims in flight and every claim after it sees it;
a run of a paused queue, or of one at its cap, is handed back (jobs.queues.run_hand_back).

At a relay step: a paused queue (its lanes too) is passed over; a capped queue publishes
no more than its cap leaves (runs running, or published and not yet claimed); a
rate-limited one no more than the tokens it takes from its bucket (unused ones go back).
The controls are read once per step, so a pause reaches every relay within its poll
interval (at most a second); the workers' gate reads it at every claim.
"""

from __future__ import annotations

import math

from django.db import transaction

from jobs.clock import db_now
from jobs.counters import counter_increment
from jobs.lanes import LANES
from jobs.queues import run_hand_back
from storage.queues import (
    QueueHold,
    queue_running_count,
    queue_tokens_return,
    queue_tokens_take,
    queues_held,
    run_gate_lock,
)


def queue_holds_run(*, run_id: str) -> bool:
    """In the claim's transaction: whether the run's queue holds it back (paused, or at
    its cap), in which case it was handed back to wait in PostgreSQL. The queue row stays
    locked until the claim's transaction ends."""
    gate = run_gate_lock(run_id=run_id)
    if gate is None:
        return False
    full = gate.max_running is not None and (
        queue_running_count(queue=gate.queue, in_broker=False) >= gate.max_running
    )
    if not (gate.paused or full):
        return False
    if run_hand_back(run_id=run_id, now=db_now()):
        counter_increment("scheduler_runs_handed_back_total",
                          labels={"queue": gate.queue, "reason": "paused" if gate.paused
                                  else "max_running"})  # fmt: skip
    return True


def queue_of_lane(name: str) -> str:
    """The configured queue a Celery queue belongs to (a lane's, or itself)."""
    for lane in LANES.values():
        if name.endswith(f".{lane}"):
            return name[: -len(lane) - 1]
    return name


class QueueRoom:
    """The controls of one relay step, read once: what each queue may publish."""

    def __init__(self) -> None:
        self.held: dict[str, QueueHold] = queues_held()

    def room(self, name: str) -> float:
        """How many of the Celery queue `name`'s rows may be published this step, before
        its rate (the tokens are taken separately): 0 when its queue is paused."""
        hold = self.held.get(queue_of_lane(name))
        if hold is None:
            return math.inf
        if hold.paused:
            return 0
        if hold.max_running is not None:
            active = queue_running_count(queue=hold.name, in_broker=True)
            return max(0, hold.max_running - active)
        return math.inf

    def take(self, name: str, wanted: int) -> int:
        """Tokens for up to `wanted` publications of the queue (all of them without a
        rate), in a short transaction of their own."""
        hold = self.held.get(queue_of_lane(name))
        if hold is None or not hold.rate_limited or wanted <= 0:
            return wanted
        with transaction.atomic():
            return queue_tokens_take(queue=hold.name, wanted=wanted)

    def give_back(self, name: str, count: int) -> None:
        hold = self.held.get(queue_of_lane(name))
        if hold is not None and hold.rate_limited and count > 0:
            queue_tokens_return(queue=hold.name, count=count)
