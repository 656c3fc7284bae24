"""The outbox relay in process, against the real RabbitMQ vhost of this test session."""

import datetime as dt
import json

import pytest
from celery import current_app
from django.conf import settings
from kombu import Connection

from dispatch.relay import ConfirmingPublisher, RelayConfig, relay_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import OutboxMessage, OutboxState, Run
from tests.processes import purge_queue

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def pending_runs(make_job):
    purge_queue()

    def make(count: int) -> list[Run]:
        for _ in range(count):
            make_job(
                now=NOW - dt.timedelta(minutes=1),
                schedule={"kind": "once", "run_at": NOW.isoformat()},
            )
        scheduler_run_once(now=NOW, config=SchedulerConfig())
        return list(Run.objects.all())

    yield make
    purge_queue()


def _drain_queue() -> list[dict]:
    """Every message now in the `jobs` queue, as (headers, body)."""
    with Connection(settings.CELERY_BROKER_URL) as broker:
        # Declared as the product declares it (classic or quorum).
        queue = broker.SimpleQueue(current_app.amqp.queues["jobs"], no_ack=True)
        messages = []
        while True:
            try:
                message = queue.get(timeout=1)
            except queue.Empty:
                return messages
            messages.append({"headers": message.headers, "body": json.loads(message.body)})


def test_relay_publishes_celery_task_messages_and_marks_rows_after_the_confirm(pending_runs):
    runs = pending_runs(3)
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        result = relay_run_once(now=NOW, config=RelayConfig(batch_size=2), publisher=publisher)
        assert (result.published, result.batch_full) == (2, True)
        result = relay_run_once(now=NOW, config=RelayConfig(batch_size=2), publisher=publisher)
        assert (result.published, result.batch_full) == (1, False)
        assert relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher).published == 0
    finally:
        publisher.close()
    assert not OutboxMessage.objects.filter(state=OutboxState.PENDING).exists()
    assert all(run.published_at == NOW for run in Run.objects.all())
    messages = _drain_queue()
    # Celery's task protocol v2: the task name in the headers, (args, kwargs, embed) as body.
    assert sorted(m["headers"]["task"] for m in messages) == ["tests.record"] * 3
    assert sorted(m["body"][1]["run_id"] for m in messages) == sorted(str(r.id) for r in runs)
    assert {m["headers"]["id"] for m in messages} == {
        str(i) for i in OutboxMessage.objects.values_list("message_id", flat=True)
    }


def test_unreachable_broker_leaves_rows_pending_with_tries_and_error(pending_runs):
    pending_runs(2)
    publisher = ConfirmingPublisher("amqp://guest:guest@127.0.0.1:1//", {"connect_timeout": 1})
    with pytest.raises(Exception) as raised:
        relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher)
    assert "refused" in str(raised.value).lower() or isinstance(raised.value, OSError)
    rows = list(OutboxMessage.objects.all())
    assert [row.state for row in rows] == [OutboxState.PENDING] * 2
    assert all(row.publish_tries == 1 and row.last_error for row in rows)
    assert not Run.objects.filter(published_at__isnull=False).exists()


def test_confirms_settle_only_the_tags_they_name():
    """RabbitMQ may confirm out of order: a single ack of tag 2 says nothing of tag 1."""
    publisher = ConfirmingPublisher("amqp://guest:guest@127.0.0.1:1//", {})
    publisher.unconfirmed = {1, 2, 3, 4}
    publisher._on_ack(2, False)
    assert publisher.unconfirmed == {1, 3, 4}
    publisher._on_ack(3, True)
    assert publisher.unconfirmed == {4}
    publisher._on_nack(2, False)  # already settled: not this batch's failure
    assert not publisher.nacked
    publisher._on_nack(4, True)
    assert publisher.nacked
