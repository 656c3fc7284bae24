"""The outbox relay: publishes pending outbox rows and marks them only once confirmed.

`relay_run_once` claims a batch of pending rows with FOR UPDATE SKIP LOCKED (so relays
split the work), publishes every message of the batch as a real Celery task message, waits
for the broker's confirms of the whole batch (one round trip, not one per message), and in
the same transaction marks the rows published. A crash anywhere before the commit leaves
the rows pending: they are published again, and the worker's claim refuses the duplicate.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time

from celery import current_app
from django.db import transaction
from kombu import Connection, Producer

from jobs.models import OutboxMessage, OutboxState
from jobs.outbox import outbox_mark_published, outbox_record_failure
from jobs.transitions import runs_mark_published

from .config import config_require
from .failpoints import failpoint
from .loop import BROKER_ERRORS

log = logging.getLogger("dispatch.relay")
# Seconds between Celery's soft time limit (the handler gets SoftTimeLimitExceeded) and its
# hard one (the pool process is killed; the reaper then records the attempt timed out).
HARD_TIME_LIMIT_GRACE = 15


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    batch_size: int = 200
    confirm_timeout: float = 15.0  # seconds to wait for a batch's confirms
    poll_interval: float = 0.2  # sleep when the outbox is empty

    def __post_init__(self) -> None:
        config_require(
            self, at_least_one=("batch_size",), positive=("confirm_timeout", "poll_interval")
        )


@dataclasses.dataclass(frozen=True)
class RelayResult:
    published: int
    batch_full: bool


class BrokerUnconfirmed(ConnectionError):
    """The broker nacked the batch or did not confirm it in time; the rows stay pending."""


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
        self.nacked = False

    def _open(self) -> None:
        if self.channel is not None:
            return
        self.connection.ensure_connection(max_retries=1)
        self.channel = self.connection.channel()
        self.confirms = self.connection.transport.driver_type == "amqp"
        self.sent, self.unconfirmed, self.nacked = 0, set(), False
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
            return {tag for tag in self.unconfirmed if tag <= delivery_tag}
        return {delivery_tag} & self.unconfirmed

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self.unconfirmed -= self._settled(delivery_tag, multiple)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        if self._settled(delivery_tag, multiple):
            self.nacked = True

    def publish_batch_and_confirm(self, messages: list[OutboxMessage], timeout: float) -> None:
        """Publish every message, then wait until the broker confirmed all of them."""
        self._open()
        app = current_app
        producer = Producer(self.channel, serializer="json", auto_declare=False)
        for message in messages:
            queue = app.amqp.queues[message.queue]
            task = app.amqp.as_task_v2(
                str(message.message_id),
                message.task_name,
                args=(),
                kwargs={"run_id": str(message.run_id)},
                soft_time_limit=message.timeout_seconds,
                time_limit=(
                    message.timeout_seconds + HARD_TIME_LIMIT_GRACE
                    if message.timeout_seconds
                    else None
                ),
            )
            producer.publish(
                task.body,
                exchange=queue.exchange,
                routing_key=queue.routing_key,
                declare=[queue],
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
        if not self.confirms:
            return
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
        self.channel = None

    def close(self) -> None:
        self.connection.release()


def relay_run_once(
    *, now: dt.datetime, config: RelayConfig, publisher: ConfirmingPublisher
) -> RelayResult:
    with transaction.atomic():
        messages = list(
            OutboxMessage.objects.select_for_update(skip_locked=True)
            .filter(state=OutboxState.PENDING)
            .order_by("id")[: config.batch_size]
        )
        if not messages:
            return RelayResult(published=0, batch_full=False)
        ids = [message.id for message in messages]
        try:
            publisher.publish_batch_and_confirm(messages, timeout=config.confirm_timeout)
        except BROKER_ERRORS as exc:
            publisher.reset()
            failure = exc
        else:
            failpoint("relay.after_confirm")
            outbox_mark_published(message_ids=ids, now=now)
            runs_mark_published(run_ids=[message.run_id for message in messages], now=now)
            return RelayResult(published=len(ids), batch_full=len(ids) >= config.batch_size)
    outbox_record_failure(message_ids=ids, error=failure)
    raise failure
