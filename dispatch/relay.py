"""The outbox relay: publishes pending outbox rows and deletes them only once confirmed.

`relay_run_once` works queue by queue (each queue's lanes are queues of their own,
jobs.lanes): it claims a batch of a queue's pending rows with FOR UPDATE SKIP LOCKED (so
relays split the work), no more than the queue's high-water mark leaves room for
(backpressure), shared among the rows' owners in turn, an owner at its limit passed over
(dispatch.shares), publishes every message of the batch as a real Celery task message,
waits for the broker's confirms of the whole batch (one round trip, not one per message),
and in the same transaction deletes the rows: a confirmed row has nothing left to say, and the run
row is not touched (the worker's claim records `published_at`, which travels in the
message). A crash anywhere before the commit leaves the rows pending: they are published
again, and the worker's claim refuses the duplicate.

Publishing is the relay's hot path, so a message is not built by Celery and kombu one at a
time: Celery's `as_task_v2` and kombu's encoding make one template per (task, queue,
priority, time limit), with placeholders of fixed length where the task id, the run id and
the publication time go; each message is the template with those three substituted. On
AMQP the template is the message's encoded frames and a batch is written to the socket in
a few writes (`tests/dispatch/test_relay.py` checks that a consumer receives the same
headers, properties and body as from kombu's Producer); other transports (the embedded
filesystem broker) publish through kombu's Producer.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import logging
import math
import struct
import time
import uuid

from amqp.exceptions import ChannelError
from amqp.serialization import dumps as amqp_dumps
from celery import current_app
from django.db import connection, transaction
from kombu import Connection, Producer
from kombu.serialization import dumps as kombu_dumps

from jobs.audit import audit_record
from jobs.models import FailureReason, OutboxMessage, OutboxState
from jobs.outbox import outbox_delete_published, outbox_record_failure
from jobs.redaction import redact
from jobs.registry import task_pack_size
from jobs.transitions import active_runs_record, run_give_up, runs_stamp_published_late

from .config import config_require
from .failpoints import failpoint
from .loop import BROKER_ERRORS
from .packing import outbox_packs, pack_time_limit
from .shares import MAX_QUEUES, OwnerTurns, allowances, claim_shares
from .worker.limits import HARD_TIME_LIMIT_GRACE, PACK_RUN_GRACE_SECONDS

log = logging.getLogger("dispatch.relay")
# Placeholders of the exact length of what replaces them (a UUID's 36 characters; an
# ISO 8601 UTC instant with microseconds, 32), so every length encoded around them holds.
TASK_ID_MARK = "ffffffff-ffff-4fff-bfff-fffffffffff1"
RUN_ID_MARK = "ffffffff-ffff-4fff-bfff-fffffffffff2"
PUBLISHED_AT_MARK = "9999-12-31T23:59:59.999999+00:00"
WRITE_CHUNK = 256 * 1024  # bytes per socket write when a batch is sent


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    batch_size: int = 1000
    confirm_timeout: float = 15.0  # seconds to wait for a batch's confirms
    # The sleep when the outbox is empty; the relay command also wakes on a NOTIFY from
    # every writer of outbox rows (jobs.outbox), so this is only the safety net.
    poll_interval: float = 1.0
    # A queue the broker refuses on the channel (declared with other arguments or type, a
    # reserved `amq.` name, no permission): its messages are tried in this many steps, then
    # their runs fail `undeliverable` with the broker's reason.
    max_refusals: int = 5
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
            at_least_one=("batch_size", "max_refusals", "high_water", "owner_max_active_runs"),
            positive=("confirm_timeout", "poll_interval", "held_poll_interval"),
        )


@dataclasses.dataclass(frozen=True)
class RelayResult:
    published: int
    batch_full: bool
    undeliverable: int = 0
    # Queues whose rows waited this step for room in the broker or for an owner's limit.
    held_back: int = 0


@dataclasses.dataclass(frozen=True)
class PendingMessage:
    """What the relay reads of an outbox row."""

    id: int
    message_id: uuid.UUID
    run_id: uuid.UUID
    task_name: str
    queue: str
    priority: int
    timeout_seconds: int | None
    created_at: dt.datetime | None = None
    owner_id: object = None


# The columns claimed, the owner's id last (dispatch.shares adds it).
PENDING_FIELDS = [field.name for field in dataclasses.fields(PendingMessage)][:-1]


class BrokerUnconfirmed(ConnectionError):
    """The broker nacked the batch or did not confirm it in time; the rows stay pending."""


def published_at_text(now: dt.datetime) -> str:
    """The publication time as it travels in the message: ISO 8601, UTC, microseconds."""
    text = now.astimezone(dt.UTC).isoformat(timespec="microseconds")
    if len(text) != len(PUBLISHED_AT_MARK):
        raise ValueError(f"unexpected timestamp {text!r}")
    return text


def task_message(message: PendingMessage, *, task_id: str, run_id: str, published_at: str):
    """The Celery task message (protocol v2) of an outbox row."""
    return current_app.amqp.as_task_v2(
        task_id,
        message.task_name,
        args=(),
        kwargs={"run_id": run_id, "published_at": published_at},
        soft_time_limit=message.timeout_seconds,
        time_limit=(
            message.timeout_seconds + HARD_TIME_LIMIT_GRACE if message.timeout_seconds else None
        ),
    )


def packed_task_message(pack: list[PendingMessage], *, published_at: str):
    """The Celery task message of several runs of one short task (dispatch.packing): the
    first row's id is the task id; each run gets its own soft time limit from the worker,
    the message a hard limit with room for all of them."""
    first = pack[0]
    return current_app.amqp.as_task_v2(
        str(first.message_id),
        first.task_name,
        args=(),
        kwargs={
            "run_ids": [str(message.run_id) for message in pack],
            "published_at": published_at,
            "timeout_seconds": first.timeout_seconds,
        },
        # Room per run for its limit, its grace, and the claim's and the outcome's retries
        # through a database outage (dispatch.worker).
        time_limit=pack_time_limit(
            first.timeout_seconds,
            len(pack),
            PACK_RUN_GRACE_SECONDS,
        ),
    )


class ConfirmingPublisher:
    """One broker connection; on AMQP, a channel in confirm mode with batched confirms.

    Transports without publisher confirms (the embedded filesystem broker) have written the
    message durably when publish returns, so their confirm step is a no-op.
    """

    def __init__(self, broker_url: str, transport_options: dict) -> None:
        options = {k: v for k, v in transport_options.items() if k != "confirm_publish"}
        self.connection = Connection(broker_url, transport_options=options)
        self.channel = None
        self.confirms = False
        self.sent = 0  # the channel's last delivery tag (confirm mode numbers from 1)
        self.unconfirmed: set[int] = set()
        self.floor = 1  # no tag below it is unconfirmed
        self.nacked = False
        self.declared: set[str] = set()  # queues declared on this channel
        self.depth_channel = None  # where queue depths are asked (a refusal closes it)
        self.templates: dict[tuple, bytes] = {}  # encoded frames with placeholders, by key

    def _open(self) -> None:
        if self.channel is not None:
            return
        self.connection.ensure_connection(max_retries=1)
        self.channel = self.connection.channel()
        self.confirms = self.connection.transport.driver_type == "amqp"
        self.sent, self.unconfirmed, self.floor, self.nacked = 0, set(), 1, False
        self.declared, self.templates, self.depth_channel = set(), {}, None
        if self.confirms:
            self.channel.confirm_select()
            self.channel.events["basic_ack"].add(self._on_ack)
            self.channel.events["basic_nack"].add(self._on_nack)

    def _settled(self, delivery_tag: int, multiple: bool) -> set[int]:
        """The tags one confirm settles: every tag up to it with `multiple`, else that one.

        RabbitMQ may confirm out of order (messages to different queues persist
        independently), so a single ack of a higher tag says nothing of the lower ones.
        """
        if multiple:
            settled = self.unconfirmed.intersection(range(self.floor, delivery_tag + 1))
            self.floor = max(self.floor, delivery_tag + 1)
            return settled
        return {delivery_tag} & self.unconfirmed

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self.unconfirmed -= self._settled(delivery_tag, multiple)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        if self._settled(delivery_tag, multiple):
            self.nacked = True

    def declare(self, queue_name: str):
        """The Celery queue of that name, declared once per channel."""
        self._open()
        return self._declare(queue_name)

    def queue_depth(self, queue_name: str) -> int | None:
        """The queue's ready messages, asked with a passive declare (one round trip, on a
        channel of its own); 0 for a queue not declared yet. None where the transport cannot
        tell (the embedded filesystem broker) or the broker will not say (no permission):
        then there is no backpressure, and a refused publish shows the reason."""
        self._open()
        if not self.confirms:
            return None
        if self.depth_channel is None:
            self.depth_channel = self.connection.channel()
        try:
            return self.depth_channel.queue_declare(queue=queue_name, passive=True).message_count
        except ChannelError as exc:
            self.depth_channel = None  # the broker closed the channel with its refusal
            if exc.code == 404:
                return 0
            log.warning("the broker did not tell the depth of queue %r: %s", queue_name, exc)
            return None

    def _declare(self, queue_name: str):
        """The Celery queue of that name, declared once per channel (open)."""
        queue = current_app.amqp.queues[queue_name]
        if queue_name not in self.declared:
            queue(self.channel).declare()
            self.declared.add(queue_name)
        return queue

    def _frames_template(self, message: PendingMessage) -> bytes:
        """The AMQP frames (basic.publish, content header, body) of the message, with
        placeholders for the task id, run id and publication time; kombu encodes them."""
        key = (message.task_name, message.queue, message.priority, message.timeout_seconds)
        template = self.templates.get(key)
        if template is not None:
            return template
        queue = self._declare(message.queue)
        task = task_message(
            message, task_id=TASK_ID_MARK, run_id=RUN_ID_MARK, published_at=PUBLISHED_AT_MARK
        )
        content_type, content_encoding, body = kombu_dumps(task.body, serializer="json")
        body = body.encode(content_encoding) if isinstance(body, str) else body
        amqp_message = self.channel.prepare_message(
            body,
            message.priority or None,
            content_type,
            content_encoding,
            task.headers,
            {"delivery_mode": 2, **task.properties},
        )
        channel_id = self.channel.channel_id
        frame_max = self.channel.connection.frame_max
        publish = struct.pack(">HH", 60, 40) + amqp_dumps(
            "Bssbb", (0, queue.exchange.name, queue.routing_key, False, False)
        )
        header = struct.pack(">HHQ", 60, 0, len(body)) + amqp_message._serialize_properties()
        if len(body) > frame_max - 8 or len(header) > frame_max - 8:
            raise ValueError("a task message larger than one frame")  # kwargs are two ids
        template = b"".join(
            struct.pack(">BHI", kind, channel_id, len(payload)) + payload + b"\xce"
            for kind, payload in ((1, publish), (2, header), (3, body))
        )
        self.templates[key] = template
        return template

    def _publish_amqp(self, messages: list[PendingMessage], published_at: str) -> None:
        at = published_at.encode()
        chunk: list[bytes] = []
        size = 0
        write = self.connection.connection.transport.write
        for message in messages:
            frames = (
                self._frames_template(message)
                .replace(TASK_ID_MARK.encode(), str(message.message_id).encode())
                .replace(RUN_ID_MARK.encode(), str(message.run_id).encode())
                .replace(PUBLISHED_AT_MARK.encode(), at)
            )
            chunk.append(frames)
            size += len(frames)
            self.sent += 1
            self.unconfirmed.add(self.sent)
            if size >= WRITE_CHUNK:
                write(b"".join(chunk))
                chunk, size = [], 0
        if chunk:
            write(b"".join(chunk))
        self.connection.connection.bytes_sent += 1  # what py-amqp counts for heartbeats

    def _publish_kombu(self, packs: list[list[PendingMessage]], published_at: str) -> None:
        """Through kombu's Producer: on transports without confirms, and for packs (whose
        run lists make no fixed-length template). On a channel in confirm mode each
        publish takes the next delivery tag, as the template path's do."""
        producer = Producer(self.channel, serializer="json", auto_declare=False)
        for pack in packs:
            message = pack[0]
            queue = self._declare(message.queue)
            if len(pack) > 1:
                task = packed_task_message(pack, published_at=published_at)
            else:
                task = task_message(
                    message,
                    task_id=str(message.message_id),
                    run_id=str(message.run_id),
                    published_at=published_at,
                )
            producer.publish(
                task.body,
                exchange=queue.exchange,
                routing_key=queue.routing_key,
                headers=task.headers,
                delivery_mode=2,
                priority=message.priority or None,
                serializer="json",
                retry=False,
                **task.properties,
            )
            self.sent += 1
            if self.confirms:
                self.unconfirmed.add(self.sent)

    def publish_batch_and_confirm(
        self, messages: list[PendingMessage], *, published_at: str, timeout: float
    ) -> None:
        """Publish every message (the runs of short tasks packed several to a message,
        dispatch.packing), then wait until the broker confirmed all of them."""
        self._open()
        packs = outbox_packs(messages, pack_size=task_pack_size)
        if not self.confirms:
            self._publish_kombu(packs, published_at)
            return
        self.floor = self.sent + 1  # every earlier tag was settled (or the channel reset)
        self._publish_amqp([pack[0] for pack in packs if len(pack) == 1], published_at)
        self._publish_kombu([pack for pack in packs if len(pack) > 1], published_at)
        deadline = time.monotonic() + timeout
        while self.unconfirmed and not self.nacked:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self.connection.drain_events(timeout=min(remaining, 1.0))
            except TimeoutError:
                continue
        if self.nacked or self.unconfirmed:
            self.reset()
            raise BrokerUnconfirmed(f"{len(messages)} messages not confirmed by the broker")

    def reset(self) -> None:
        try:
            self.connection.close()
        except Exception:  # noqa: BLE001 - the connection is being thrown away
            log.debug("closing a broken broker connection failed", exc_info=True)
        self.connection = self.connection.clone()
        self.channel = self.depth_channel = None

    def close(self) -> None:
        self.connection.release()


def relay_run_once(
    *,
    now: dt.datetime,
    config: RelayConfig,
    publisher: ConfirmingPublisher,
    turns: OwnerTurns | None = None,
) -> RelayResult:
    """Publish pending rows queue by queue, each queue in its own transaction: up to a
    batch, and no more than the room its high-water mark leaves (the broker's count of its
    ready messages, asked once per queue per step). A full queue's rows wait; a queue the
    broker refuses keeps its rows pending (a try counted each step, then `undeliverable`);
    neither holds back another queue. Within a queue, owners share the room in turn and an
    owner at its limit is passed over (dispatch.shares; `turns` rotates who goes first,
    kept by the relay's process across steps). An outage stops the step (the loop backs
    off)."""
    turns = turns or OwnerTurns()
    published_at = published_at_text(now)
    published = undeliverable = held_back = 0
    batch_full = False
    for queue in _pending_queues():
        room = _room(queue, config=config, publisher=publisher)
        if room <= 0:
            held_back += 1
            continue
        limit = min(room, config.batch_size)
        sent, refused, owners_held = _relay_queue(
            queue, limit=limit, now=now, published_at=published_at, config=config,
            publisher=publisher, turns=turns,
        )  # fmt: skip
        published += sent
        undeliverable += refused
        if sent >= limit:
            batch_full |= limit == config.batch_size
        held_back += owners_held or (sent >= limit and limit < config.batch_size)
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


def _pending_queues() -> list[str]:
    """The queues that have pending rows. On PostgreSQL the index is skipped through, one
    probe per queue, whatever the number of rows waiting (a loose index scan)."""
    if connection.vendor != "postgresql":
        pending = OutboxMessage.objects.filter(state=OutboxState.PENDING)
        return list(pending.order_by("queue").values_list("queue", flat=True).distinct())
    table = OutboxMessage._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH RECURSIVE queues (queue) AS (
                (SELECT queue FROM {table} WHERE state = %(pending)s ORDER BY queue LIMIT 1)
                UNION ALL
                SELECT (SELECT o.queue FROM {table} AS o
                         WHERE o.state = %(pending)s AND o.queue > queues.queue
                         ORDER BY o.queue LIMIT 1)
                  FROM queues WHERE queues.queue IS NOT NULL
            )
            SELECT queue FROM queues WHERE queue IS NOT NULL LIMIT %(limit)s
            """,
            {"pending": OutboxState.PENDING, "limit": MAX_QUEUES},
        )
        return [queue for (queue,) in cursor.fetchall()]


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
) -> tuple[int, int, bool]:
    """Claim up to `limit` of the queue's pending rows, shared among their owners in turn
    (each owner's by priority, then oldest first; an owner at its limit passed over),
    publish them and wait for the confirms, then delete them: (published, undeliverable,
    whether an owner's rows waited for its limit)."""
    with transaction.atomic():
        found = turns.owners(queue)
        allowed, limited = allowances(found, default_limit=config.owner_max_active_runs)
        owners = list(found)
        rows = claim_shares(queue, room=limit, owners=owners, allowed=allowed,
                            fields=PENDING_FIELDS)  # fmt: skip
        messages = [PendingMessage(*row) for row in rows]
        # An owner that got all it was allowed (at its limit now) may have more waiting.
        claimed = collections.Counter(message.owner_id for message in messages)
        owners_held = any(
            allowed[owner] is not None and claimed[owner] >= allowed[owner] for owner in owners
        )
        if not messages:
            return 0, 0, owners_held
        ids = [message.id for message in messages]
        try:
            publisher.publish_batch_and_confirm(
                messages, published_at=published_at, timeout=config.confirm_timeout
            )
        except ChannelError as exc:
            # A refusal on the channel, not an outage: this queue's rows wait, a try
            # counted, and the other queues go on (SPEC, "Security").
            publisher.reset()
            log.warning("the broker refused queue %r: %s", queue, exc)
            outbox_record_failure(message_ids=ids, error=exc)
            return 0, _runs_undeliverable(queue=queue, ids=ids, reason=exc, now=now,
                                          config=config), owners_held  # fmt: skip
        except BROKER_ERRORS as exc:
            publisher.reset()
            failure = exc
        else:
            failpoint("relay.after_confirm")
            outbox_delete_published(message_ids=ids)
            late = now - dt.timedelta(seconds=LATE_PUBLICATION_SECONDS)
            runs_stamp_published_late(
                run_ids=[m.run_id for m in messages if m.created_at and m.created_at < late],
                now=now,
            )
            active_runs_record(
                runs=[(m.run_id, m.owner_id) for m in messages if m.owner_id in limited], now=now
            )
            return len(ids), 0, owners_held
    outbox_record_failure(message_ids=ids, error=failure)
    raise failure


def _runs_undeliverable(
    *, queue: str, ids: list[int], reason: BaseException, now: dt.datetime, config: RelayConfig
) -> int:
    """Fail the runs of the rows among `ids` that the broker refused `max_refusals` times,
    with its reason in their history, and delete those rows; how many runs failed."""
    spent = OutboxMessage.objects.filter(id__in=ids, publish_tries__gte=config.max_refusals)
    failed = 0
    for row_id, run_id, job_id in spent.values_list("id", "run_id", "run__job_id"):
        if run_give_up(run_id=run_id, now=now, reason=FailureReason.UNDELIVERABLE):
            failed += 1
            audit_record(action="run.undeliverable", by="relay", job_id=job_id, run_id=run_id,
                         data={"queue": queue, "refusals": config.max_refusals,
                               "reason": redact(str(reason))[:500]})  # fmt: skip
        OutboxMessage.objects.filter(id=row_id).delete()
    if failed:
        log.error("queue %r refused by the broker %s times: %s runs failed undeliverable (%s)",
                  queue, config.max_refusals, failed, reason)  # fmt: skip
    return failed


def queues_declare(publisher: ConfirmingPublisher, names: list[str]) -> list[str]:
    """Declare the allowed queues (SCHEDULER_QUEUES) at a relay's start, so that a
    misconfigured one shows at once; the names the broker refused (each logged)."""
    refused = []
    for name in names:
        try:
            publisher.declare(name)
        except ChannelError as exc:
            publisher.reset()
            refused.append(name)
            log.error("the broker refused to declare queue %r: %s", name, exc)
        except BROKER_ERRORS as exc:
            publisher.reset()
            log.warning("broker unreachable (%s): queues are declared when it answers", exc)
            break
    return refused
