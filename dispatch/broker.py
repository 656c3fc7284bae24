"""The broker, as the relay and the processes that ask it things see it: connect, declare
the allowed queues, ask a queue's depth, and publish outbox rows as Celery task messages
with publisher confirms. Everything here talks AMQP (or kombu, for the embedded filesystem
broker); the policy of what to publish, and when, is dispatch.relay's.

Publishing is the relay's hot path, so a message is not built by Celery and kombu one at a
time: Celery's `as_task_v2` and kombu's encoding make one template per (task, queue,
priority, time limit), with placeholders of fixed length where the task id, the run id and
the publication time go; each message is the template with those three substituted. On
AMQP the template is the message's encoded frames and a batch is written to the socket in
a few writes (`tests/dispatch/test_relay.py` checks that a consumer receives the same
headers, properties and body as from kombu's Producer); other transports (the embedded
filesystem broker) publish through kombu's Producer.

Every AMQP message is published `mandatory`: one the broker can route to no queue (its
queue was deleted since the channel declared it) comes back as a basic.return before its
confirm, and is not published: its rows stay, and its queue is declared again.
"""

from __future__ import annotations

import datetime as dt
import logging
import struct
import time
from collections.abc import Callable

from amqp.exceptions import ChannelError
from amqp.serialization import dumps as amqp_dumps
from celery import current_app
from kombu import Connection, Producer
from kombu.serialization import dumps as kombu_dumps

from jobs.registry import task_pack_size
from storage.outbox import PendingMessage

from .loop import BROKER_ERRORS
from .packing import outbox_packs, pack_time_limit
from .worker.limits import HARD_TIME_LIMIT_GRACE, PACK_RUN_GRACE_SECONDS

log = logging.getLogger("dispatch.broker")
# Placeholders of the exact length of what replaces them (a UUID's 36 characters; an
# ISO 8601 UTC instant with microseconds, 32), so every length encoded around them holds.
TASK_ID_MARK = "ffffffff-ffff-4fff-bfff-fffffffffff1"
RUN_ID_MARK = "ffffffff-ffff-4fff-bfff-fffffffffff2"
PUBLISHED_AT_MARK = "9999-12-31T23:59:59.999999+00:00"
WRITE_CHUNK = 256 * 1024  # bytes per socket write when a batch is sent

# A refusal on the channel, not an outage: the broker closes the channel; the connection
# lives. Some last until an operator acts (LASTING_REFUSALS); the others pass by themselves.
BrokerRefusal = ChannelError
# The refusals that last until an operator acts: a queue declared with other arguments or
# type (406 PRECONDITION_FAILED), a reserved `amq.` name or no permission (403
# ACCESS_REFUSED). Any other can pass: 404 NOT_FOUND (a cluster's queue whose home node is
# down or restarting, an exchange deleted and declared again), 405 RESOURCE_LOCKED (a queue
# another connection holds exclusive).
LASTING_REFUSALS = frozenset({403, 406})


def refusal_lasts(refusal: BaseException) -> bool:
    """Whether the broker's refusal lasts until an operator acts (LASTING_REFUSALS)."""
    return getattr(refusal, "code", None) in LASTING_REFUSALS


class BrokerUnconfirmed(ConnectionError):
    """The broker nacked the batch or did not confirm it in time; the rows stay pending."""


class BrokerUnrouted(Exception):
    """The broker returned messages it could route to no queue (a mandatory publish): their
    queue was deleted since the channel declared it. Their rows stay pending."""


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


def queue_depth(channel, queue_name: str) -> int | None:
    """The queue's ready messages, asked with a passive declare on `channel` (one round
    trip); 0 for a queue not declared yet. None where the broker will not say (no
    permission): the caller then holds nothing back, and a refused publish shows the
    reason. A refusal closes the channel; an outage raises (BROKER_ERRORS)."""
    try:
        return channel.queue_declare(queue=queue_name, passive=True).message_count
    except ChannelError as exc:
        if str(exc.code) == "404":  # an int from RabbitMQ, a string from kombu's transports
            return 0
        log.warning("the broker did not tell the depth of queue %r: %s", queue_name, exc)
        return None


class ConfirmingPublisher:
    """One broker connection; on AMQP, a channel in confirm mode with batched confirms.

    Transports without publisher confirms (the embedded filesystem broker) have written the
    message durably when publish returns, so their confirm step is a no-op. The queues
    declared and the frames' templates are the channel's: they go with it.
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
        self.returned: set[str] = set()  # task ids of the batch's messages routed nowhere
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
        self.returned, self.declared, self.templates, self.depth_channel = set(), set(), {}, None
        if self.confirms:
            self.channel.confirm_select()
            self.channel.events["basic_ack"].add(self._on_ack)
            self.channel.events["basic_nack"].add(self._on_nack)
            self.channel.events["basic_return"].add(self._on_return)

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

    def _on_return(self, exc, exchange: str, routing_key: str, message) -> None:
        """A mandatory message routed to no queue (sent before its confirm): its task id
        (the correlation id) marks it as not published."""
        self.returned.add(message.properties.get("correlation_id"))

    def declare(self, queue_name: str):
        """The Celery queue of that name, declared once per channel."""
        self._open()
        return self._declare(queue_name)

    def queue_depth(self, queue_name: str) -> int | None:
        """The queue's ready messages (`queue_depth`, on a channel of its own); None where
        the transport cannot tell (the embedded filesystem broker) or the broker will not
        say."""
        self._open()
        if not self.confirms:
            return None
        if self.depth_channel is None:
            self.depth_channel = self.connection.channel()
        try:
            return queue_depth(self.depth_channel, queue_name)
        finally:
            if not self.depth_channel.is_open:
                self.depth_channel = None  # the broker closed it with its refusal

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
            "Bssbb", (0, queue.exchange.name, queue.routing_key, True, False)
        )  # mandatory: a message routed to no queue comes back (_on_return)
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
                mandatory=self.confirms,
                **task.properties,
            )
            self.sent += 1
            if self.confirms:
                self.unconfirmed.add(self.sent)

    def publish_batch_and_confirm(
        self,
        messages: list[PendingMessage],
        *,
        published_at: str,
        timeout: float,
        pack_size: Callable[[str], int] = task_pack_size,
    ) -> list[PendingMessage]:
        """Publish every message (the runs of short tasks packed several to a message,
        `pack_size` runs of a task at most, dispatch.packing), then wait until the broker
        confirmed all of them; the messages it returned, routed to no queue (their queue
        was deleted), which are not published: their queues are declared again on the next
        publish."""
        self._open()
        packs = outbox_packs(messages, pack_size=pack_size)
        if not self.confirms:
            self._publish_kombu(packs, published_at)
            return []
        for name in dict.fromkeys(message.queue for message in messages):
            self._declare(name)  # a queue returned earlier is declared again
        self.floor = self.sent + 1  # every earlier tag was settled (or the channel reset)
        self.returned = set()
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
        # A pack's task id is its first run's message id (packed_task_message).
        unrouted = [row for pack in packs if str(pack[0].message_id) in self.returned
                    for row in pack]  # fmt: skip
        self.declared -= {row.queue for row in unrouted}
        return unrouted

    def reset(self) -> None:
        try:
            self.connection.close()
        except Exception:  # noqa: BLE001 - the connection is being thrown away
            log.debug("closing a broken broker connection failed", exc_info=True)
        self.connection = self.connection.clone()
        self.channel = self.depth_channel = None

    def close(self) -> None:
        self.connection.release()


def queues_declare(publisher: ConfirmingPublisher, names: list[str]) -> list[str]:
    """Declare the allowed queues (SCHEDULER_QUEUES and their lanes) when a relay or a
    worker starts, so that a misconfigured one shows at once; the names the broker refused
    (each logged). An unreachable broker stops the declarations: they are made as the
    queues are first used."""
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
