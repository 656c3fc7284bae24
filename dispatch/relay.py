"""The outbox relay: publishes pending outbox rows and deletes them only once confirmed.

`relay_run_once` works queue by queue (each queue's lanes are queues of their own,
jobs.lanes). For each queue, in a short transaction, it claims a batch of pending rows
with FOR UPDATE SKIP LOCKED (so relays split the work), no more than the queue's
high-water mark leaves room for (backpressure), shared among the rows' owners in turn, an
owner at its limit passed over (dispatch.shares), and stamps them with the step's claim
(`claimed_by`, `claimed_until`: a lease of `claim_lease` seconds on the database's clock)
before it commits. Then, in no transaction, it publishes every message of the batch as a
real Celery task message and waits for the broker's confirms of the whole batch (one round
trip, not one per message). Then, in a second short transaction, it deletes the rows still
claimed by the step: a confirmed row has nothing left to say, and the run row is not
touched (the worker's claim records `published_at`, which travels in the message).

Nothing another relay needs is held across the broker's round trip: the owners' advisory
locks and the rows' locks last only the claim's transaction. A relay frozen or dead after
its claim holds its rows back for at most the lease; then any relay claims and publishes
them again, and the worker's claim refuses the duplicate (a run is claimed once). A
failure before the rows are deleted leaves them pending: they are published again (at
once after an outage or a refusal, which give the claim up; after the lease otherwise). A
message the broker returns, routed to no queue (an operator deleted its queue), is not
published: its row stays, and the queue is declared again for the next try.

A refusal is judged by its kind and how long it lasts, never by a count of tries: one that
can pass by itself (404, 405: dispatch.broker's LASTING_REFUSALS) and an outage never fail
a run; the runs of rows refused in a lasting way (406, 403) at every try for longer than
`refusal_grace` fail `undeliverable`.

What talks to the broker (connecting, declaring, depths, the messages' frames, publishing
with confirms) is dispatch.broker's; the statements are storage.outbox's and
storage.shares'. This module is the policy: which rows, how many, and what a confirm, a
refusal or an outage does to them.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import logging
import math
import time
import uuid

from django.db import transaction

from jobs.audit import audit_record
from jobs.models import FailureReason, OutboxMessage
from jobs.outbox import outbox_record_failure
from jobs.queues import queue_pauses_end_expired
from jobs.redaction import redact
from jobs.transitions import active_runs_record, run_give_up, runs_stamp_published_late
from storage.outbox import (
    CLAIM_LEASE_SECONDS,
    outbox_claim_keep,
    outbox_delete_published,
    outbox_pending_queues,
)

from .broker import (
    BrokerRefusal,
    BrokerUnrouted,
    ConfirmingPublisher,
    published_at_text,
    refusal_lasts,
)
from .config import config_require
from .failpoints import failpoint
from .loop import BROKER_ERRORS
from .packing import PackSizes
from .queues import QueueRoom
from .shares import MAX_QUEUES, OwnerTurns, allowances, claim_shares

log = logging.getLogger("dispatch.relay")


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    batch_size: int = 1000
    confirm_timeout: float = 15.0  # seconds to wait for a batch's confirms
    # Seconds a step's claim on the rows it publishes lasts (the database's clock): longer
    # than a publication and its confirm wait. A relay frozen or dead with rows claimed
    # holds them back no longer than this; then any relay publishes them again.
    claim_lease: float = CLAIM_LEASE_SECONDS
    # The sleep when the outbox is empty; the relay command also wakes on a NOTIFY from
    # every writer of outbox rows (jobs.outbox), so this is only the safety net.
    poll_interval: float = 1.0
    # Seconds a row's tries are all refused in a way that lasts until an operator acts (its
    # queue declared with other arguments or type, a reserved `amq.` name, no permission)
    # before its run fails `undeliverable` with the broker's reason; an outage or a refusal
    # that can pass in between starts the wait again, and never fails a run itself.
    refusal_grace: float = 600.0
    # Backpressure (SCHEDULER_QUEUE_HIGH_WATER): a queue's ready messages, as the broker
    # counts them before each claim, plus what one claim adds, never pass this mark; the
    # rows of a full queue wait in PostgreSQL. None: no limit.
    high_water: int | None = 10_000
    # The sleep while rows wait for room (a full queue, an owner at its limit): the relay
    # looks again this often.
    held_poll_interval: float = 0.25
    # Fair shares (SCHEDULER_OWNER_MAX_ACTIVE_RUNS): at most this many runs of one owner
    # in the broker or running at once, unless an operator set the owner's own
    # (jobs.OwnerLimit); None: unlimited.
    owner_max_active_runs: int | None = None

    def __post_init__(self) -> None:
        config_require(
            self,
            at_least_one=("batch_size", "high_water", "owner_max_active_runs"),
            positive=("confirm_timeout", "poll_interval", "held_poll_interval", "refusal_grace",
                      "claim_lease"),
        )  # fmt: skip
        if self.claim_lease <= self.confirm_timeout:
            raise ValueError("claim_lease must be longer than confirm_timeout")


@dataclasses.dataclass(frozen=True)
class RelayResult:
    published: int
    batch_full: bool
    undeliverable: int = 0
    # Queues whose rows waited this step for room in the broker or for an owner's limit.
    held_back: int = 0


def relay_run_once(
    *,
    now: dt.datetime,
    config: RelayConfig,
    publisher: ConfirmingPublisher,
    turns: OwnerTurns | None = None,
    packing: PackSizes | None = None,
) -> RelayResult:
    """Publish pending rows queue by queue, each queue in its own transaction: up to a
    batch, and no more than the room its high-water mark leaves (the broker's count of its
    ready messages, asked once per queue per step). A full queue's rows wait; a queue the
    broker refuses keeps its rows pending (a try counted each step; `undeliverable` only
    after `refusal_grace` of lasting refusals); neither holds back another queue. Within a
    queue, owners share the room in turn and an owner at its limit is passed over
    (dispatch.shares; `turns` rotates who goes first, kept by the relay's process across
    steps). `packing`: the pack sizes, kept by the relay's process across steps
    (dispatch.packing); None: only what tasks declared. An outage stops the step (the loop
    backs off)."""
    turns = turns or OwnerTurns()
    published_at = published_at_text(now)
    published = undeliverable = held_back = 0
    batch_full = False
    # A pause whose `until` has passed is ended (its rows renumbered in due order) before
    # the controls are read, so that no row of its queue goes out of order.
    queue_pauses_end_expired()
    controls = QueueRoom()
    for queue in outbox_pending_queues(limit=MAX_QUEUES):
        room = 0 if controls.paused(queue) else _room(queue, config=config, publisher=publisher)
        if room <= 0:
            held_back += 1
            continue
        limit = min(room, config.batch_size)
        sent, refused, held = _relay_queue(
            queue, limit=limit, now=now, published_at=published_at, config=config,
            publisher=publisher, turns=turns, controls=controls, packing=packing,
        )  # fmt: skip
        published += sent
        undeliverable += refused
        if sent >= limit:
            batch_full |= limit == config.batch_size
        held_back += held or (sent >= limit and limit < config.batch_size)
    return RelayResult(
        published=published,
        batch_full=batch_full,
        undeliverable=undeliverable,
        held_back=held_back,
    )


def relay_sleep(result: RelayResult, config: RelayConfig) -> float:
    """After a step (whose batch was not full): a queue at its mark is looked at again
    shortly (workers drain it meanwhile); after publishing anything, again at once (more
    may have committed); an empty outbox waits for a NOTIFY or the poll interval."""
    if result.held_back:
        return config.held_poll_interval
    return 0.0 if result.published else config.poll_interval


def _room(queue: str, *, config: RelayConfig, publisher: ConfirmingPublisher) -> float:
    """How many messages the queue takes before its high-water mark (infinite without a
    mark, or where the broker cannot count them)."""
    if config.high_water is None:
        return math.inf
    try:
        depth = publisher.queue_depth(queue)
    except BROKER_ERRORS:
        # An outage: the publish that follows fails too, and records it on the rows.
        publisher.reset()
        return math.inf
    return math.inf if depth is None else config.high_water - depth


def _publish(
    messages: list,
    *,
    now: dt.datetime,
    published_at: str,
    config: RelayConfig,
    publisher: ConfirmingPublisher,
    packing: PackSizes | None,
) -> list:
    """Publish the claimed rows and wait for the confirms; the rows routed to no queue.
    With `packing`, the runs of a task with no history yet go in two rounds: a probe
    published alone, then, once its figures are in (or after a bounded wait), the rest,
    packed if the probe showed the task short (dispatch.packing)."""
    if packing is None:
        return publisher.publish_batch_and_confirm(
            messages, published_at=published_at, timeout=config.confirm_timeout
        )
    probe, rest = packing.probe(messages)
    unrouted = []
    if probe:
        started = time.monotonic()
        unrouted += publisher.publish_batch_and_confirm(
            probe, published_at=published_at, timeout=config.confirm_timeout,
            pack_size=lambda name: 1,
        )  # fmt: skip
        packing.await_figures({message.task_name for message in probe})
        published_at = published_at_text(now + dt.timedelta(seconds=time.monotonic() - started))
    if rest:
        unrouted += publisher.publish_batch_and_confirm(
            rest, published_at=published_at, timeout=config.confirm_timeout, pack_size=packing
        )
    return unrouted


# A row published this long after it was written waited (backpressure, an owner's limit):
# its run's updated_at is stamped at publication, for reconciliation (runs_stamp_published_late).
LATE_PUBLICATION_SECONDS = 30.0


def _relay_queue(
    queue: str,
    *,
    limit: int,
    now: dt.datetime,
    published_at: str,
    config: RelayConfig,
    publisher: ConfirmingPublisher,
    turns: OwnerTurns,
    controls: QueueRoom,
    packing: PackSizes | None = None,
) -> tuple[int, int, bool]:
    """Claim up to `limit` of the queue's pending rows, shared among their owners in turn
    (each owner's by priority, then oldest first; an owner at its limit passed over), in a
    short transaction that stamps them with this step's claim; publish them and wait for
    the confirms outside any transaction; then, in a second short transaction, delete those
    still claimed by this step: (published, undeliverable, whether rows waited for an
    owner's limit or the queue's room). A capped or rate-limited queue's room (`controls`)
    is counted in the claim's transaction, under the queue's room lock. Nothing another
    relay needs (an owner's advisory lock, a row lock, the room lock) is held across the
    broker's round trip; rows whose claim ran out (this relay frozen or dead) are any
    relay's to publish again, and the worker's claim refuses the duplicate."""
    claim = uuid.uuid4()
    with transaction.atomic():
        # A capped or rate-limited queue's room, under its lock until this claim commits.
        room = controls.room(queue)
        if room <= 0:
            return 0, 0, True
        capped, limit = room < limit, min(room, limit)
        found = turns.owners(queue)
        allowed, limited = allowances(found, default_limit=config.owner_max_active_runs)
        owners = list(found)
        messages = claim_shares(queue, room=limit, owners=owners, allowed=allowed, claim=claim,
                                lease_seconds=config.claim_lease)  # fmt: skip
    # An owner that got all it was allowed (at its limit now) may have more waiting.
    claimed = collections.Counter(message.owner_id for message in messages)
    owners_held = any(
        allowed[owner] is not None and claimed[owner] >= allowed[owner] for owner in owners
    )
    owners_held |= capped and len(messages) >= limit
    if not messages:
        return 0, 0, owners_held
    ids = [message.id for message in messages]
    failpoint("relay.publishing")
    try:
        unrouted = _publish(messages, now=now, published_at=published_at, config=config,
                            publisher=publisher, packing=packing)  # fmt: skip
    except BrokerRefusal as exc:
        # A refusal on the channel, not an outage: this queue's rows wait, a try
        # counted, and the other queues go on (docs/security.md).
        publisher.reset()
        log.warning("the broker refused queue %r: %s", queue, exc)
        lasting = refusal_lasts(exc)
        with transaction.atomic():
            mine = outbox_claim_keep(message_ids=ids, claim=claim)
            outbox_record_failure(message_ids=mine, error=exc, refused_at=now if lasting else None)
            failed = _runs_undeliverable(queue=queue, ids=mine, reason=exc, now=now,
                                         config=config) if lasting else 0  # fmt: skip
        return 0, failed, owners_held
    except BROKER_ERRORS as exc:
        publisher.reset()
        with transaction.atomic():
            mine = outbox_claim_keep(message_ids=ids, claim=claim)
            outbox_record_failure(message_ids=mine, error=exc)
        raise
    failpoint("relay.after_confirm")
    with transaction.atomic():
        if unrouted:
            log.warning("the broker routed %s messages of queue %r to no queue (deleted?):"
                        " declared again for the next try", len(unrouted), queue)  # fmt: skip
            unrouted_ids = {message.id for message in unrouted}
            outbox_record_failure(
                message_ids=outbox_claim_keep(message_ids=list(unrouted_ids), claim=claim),
                error=BrokerUnrouted(f"312 NO_ROUTE: no queue bound for {queue!r}"),
            )
            messages = [m for m in messages if m.id not in unrouted_ids]
        # Only the rows still ours: one whose claim ran out and that another relay took
        # (published again, a duplicate the worker refuses) is that relay's to record.
        deleted = set(outbox_delete_published(message_ids=[m.id for m in messages], claim=claim))
        messages = [m for m in messages if m.id in deleted]
        late = now - dt.timedelta(seconds=LATE_PUBLICATION_SECONDS)
        runs_stamp_published_late(
            run_ids=[m.run_id for m in messages if m.created_at and m.created_at < late],
            now=now,
        )
        active_runs_record(
            runs=[(m.run_id, m.owner_id) for m in messages if m.owner_id in limited], now=now
        )
    return len(messages), 0, owners_held


def _runs_undeliverable(
    *, queue: str, ids: list[int], reason: BaseException, now: dt.datetime, config: RelayConfig
) -> int:
    """Fail the runs of the rows among `ids` whose every try was refused in a lasting way
    for longer than `refusal_grace`, with the broker's reason in their history, and delete
    those rows; how many runs failed."""
    since = now - dt.timedelta(seconds=config.refusal_grace)
    spent = OutboxMessage.objects.filter(id__in=ids, refused_since__lt=since)
    failed = 0
    for row_id, run_id, job_id, refused_since in spent.values_list(
        "id", "run_id", "run__job_id", "refused_since"
    ):
        if run_give_up(run_id=run_id, now=now, reason=FailureReason.UNDELIVERABLE):
            failed += 1
            audit_record(action="run.undeliverable", by="relay", job_id=job_id, run_id=run_id,
                         data={"queue": queue, "refused_since": refused_since.isoformat(),
                               "reason": redact(str(reason))[:500]})  # fmt: skip
        OutboxMessage.objects.filter(id=row_id).delete()
    if failed:
        log.error("queue %r refused by the broker for over %s s: %s runs failed undeliverable"
                  " (%s)", queue, config.refusal_grace, failed, reason)  # fmt: skip
    return failed
