"""The outbox relay in process, against the real RabbitMQ vhost of this test session."""

import dataclasses
import datetime as dt
import json
import time
import uuid

import pytest
from celery import current_app
from django.conf import settings
from kombu import Connection

from dispatch.broker import ConfirmingPublisher, published_at_text, queue_depth, queues_declare
from dispatch.loop import BROKER_ERRORS
from dispatch.relay import RelayConfig, relay_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from jobs.models import OutboxMessage, OutboxState, Run
from storage.outbox import PendingMessage
from tests.factories import run_snapshot
from tests.processes import purge_queue, wait_for

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


def _drain_queue(name: str = "jobs") -> list[dict]:
    """Every message now in the queue: its headers, properties and decoded body."""
    with Connection(settings.CELERY_BROKER_URL) as broker:
        # Declared as the product declares it (classic or quorum).
        queue = broker.SimpleQueue(current_app.amqp.queues[name], no_ack=True)
        messages = []
        while True:
            try:
                message = queue.get(timeout=1)
            except queue.Empty:
                return messages
            messages.append(
                {
                    "headers": message.headers,
                    "properties": message.properties,
                    "content": (message.content_type, message.content_encoding),
                    "body": json.loads(message.body),
                }
            )


def test_relay_publishes_celery_task_messages_and_deletes_rows_after_the_confirm(pending_runs):
    runs = pending_runs(3)
    message_ids = {str(i) for i in OutboxMessage.objects.values_list("message_id", flat=True)}
    runs_before = [run_snapshot(run.id)[0] for run in runs]
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        result = relay_run_once(now=NOW, config=RelayConfig(batch_size=2), publisher=publisher)
        assert (result.published, result.batch_full) == (2, True)
        assert OutboxMessage.objects.count() == 1
        result = relay_run_once(now=NOW, config=RelayConfig(batch_size=2), publisher=publisher)
        assert (result.published, result.batch_full) == (1, False)
        assert relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher).published == 0
    finally:
        publisher.close()
    assert not OutboxMessage.objects.exists()
    # The relay does not write the run rows: the worker's claim records `published_at`.
    assert [run_snapshot(run.id)[0] for run in runs] == runs_before
    messages = _drain_queue()
    # Celery's task protocol v2: the task name in the headers, (args, kwargs, embed) as body.
    assert sorted(m["headers"]["task"] for m in messages) == ["tests.record"] * 3
    assert sorted(m["body"][1]["run_id"] for m in messages) == sorted(str(r.id) for r in runs)
    assert {m["body"][1]["published_at"] for m in messages} == {
        NOW.isoformat(timespec="microseconds")
    }
    assert {m["headers"]["id"] for m in messages} == message_ids


def test_a_relay_given_several_broker_urls_publishes_through_one_that_answers(pending_runs):
    # kombu's failover list (CELERY_BROKER_URL "amqp://a;amqp://b"): the first node is
    # down; the relay connects to the next, and after an outage (reset) it does again.
    pending_runs(2)
    dead = settings.CELERY_BROKER_URL.replace(":5672/", ":1/")
    publisher = ConfirmingPublisher(f"{dead};{settings.CELERY_BROKER_URL}", {"connect_timeout": 2})
    try:
        result = relay_run_once(now=NOW, config=RelayConfig(batch_size=1), publisher=publisher)
        assert result.published == 1
        publisher.reset()
        assert relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher).published == 1
    finally:
        publisher.close()
    assert not OutboxMessage.objects.exists()
    assert len(_drain_queue()) == 2


def test_the_relays_encoded_frames_are_the_messages_kombu_sends():
    """The AMQP fast path (a template per task, ids substituted) against kombu's Producer."""
    purge_queue()
    first = PendingMessage(
        id=1,
        message_id=uuid.uuid4(),
        run_id=uuid.uuid4(),
        task_name="tests.record",
        queue="jobs",
        priority=3,
        timeout_seconds=30,
    )
    second = dataclasses.replace(first, id=2, message_id=uuid.uuid4(), run_id=uuid.uuid4())
    published_at = published_at_text(NOW)
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        publisher.publish_batch_and_confirm(
            [first, second], published_at=published_at, timeout=15
        )  # the second from the template the first made
        publisher._publish_kombu([[first], [second]], published_at)
    finally:
        publisher.close()
    messages = _drain_queue()
    purge_queue()

    assert len(messages) == 4
    assert messages[:2] == messages[2:]
    assert [m["body"][1] for m in messages[:2]] == [
        {"run_id": str(m.run_id), "published_at": published_at} for m in (first, second)
    ]
    assert [m["headers"]["id"] for m in messages[:2]] == [
        str(first.message_id),
        str(second.message_id),
    ]
    assert messages[0]["headers"]["timelimit"] == [45, 30]
    assert messages[0]["properties"]["priority"] == 3


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


@pytest.mark.slow
def test_the_relay_process_is_woken_by_the_commit_of_an_outbox_row(stack, make_job):
    """A relay that polls only once a minute publishes a new row long before: every writer
    of outbox rows notifies the relays (jobs.outbox), and the relay waits on LISTEN."""
    relay = stack.relay("relay", "--poll-interval", "60")
    wait_for(lambda: b"relay started" in stack.log("relay"), timeout=30, message="the relay")
    time.sleep(2)  # its first poll found the outbox empty: it now sleeps for a minute
    now = dt.datetime.now(dt.UTC)
    job = make_job(now=now, schedule={"kind": "once", "run_at": now.isoformat()})
    scheduler_run_once(now=now, config=SchedulerConfig())
    # The row committed (it may be published already: the woken relay is that quick).
    assert Run.objects.filter(job=job).exists()

    wait_for(
        lambda: not OutboxMessage.objects.filter(run__job=job).exists(),
        timeout=30,
        message="the relay to publish the row before its next poll",
    )
    assert relay.poll() is None
    assert [m["body"][1]["run_id"] for m in _drain_queue()] == [str(Run.objects.get(job=job).id)]


def test_the_runs_of_a_short_task_travel_packed_and_others_alone(make_job):
    """tests.record_packed declares pack=20: 45 of its runs take 3 messages, confirmed
    with the 2 single ones of tests.record in the same batch."""
    purge_queue()
    for index in range(47):
        make_job(
            now=NOW - dt.timedelta(minutes=1),
            task="tests.record_packed" if index < 45 else "tests.record",
            schedule={"kind": "once", "run_at": NOW.isoformat()},
        )
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        assert relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher).published == 47
    finally:
        publisher.close()
    assert not OutboxMessage.objects.exists()
    messages = _drain_queue()
    packed = [m for m in messages if m["headers"]["task"] == "tests.record_packed"]
    single = [m for m in messages if m["headers"]["task"] == "tests.record"]
    assert sorted(len(m["body"][1]["run_ids"]) for m in packed) == [5, 20, 20]
    assert len(single) == 2 and all("run_id" in m["body"][1] for m in single)
    sent = [run for m in packed for run in m["body"][1]["run_ids"]]
    expected = Run.objects.filter(job__spec__task="tests.record_packed").values_list(
        "id", flat=True
    )
    assert sorted(sent) == sorted(str(run) for run in expected)
    # Each run gets its own soft limit in the worker; the message a hard one for all.
    for message in packed:
        runs = len(message["body"][1]["run_ids"])
        assert message["body"][1]["timeout_seconds"] == 3600
        assert message["headers"]["timelimit"] == [runs * (3600 + 15 + 120), None]
    purge_queue()


@pytest.fixture
def refused_queue(settings):
    """An allowed queue that exists on the broker with other arguments, so that the relay's
    declare is refused (PRECONDITION_FAILED), as a queue of the wrong type would be."""
    name = f"refused-{uuid.uuid4().hex[:8]}"
    settings.SCHEDULER_QUEUES = [*settings.SCHEDULER_QUEUES, name]
    with Connection(settings.CELERY_BROKER_URL) as broker:
        channel = broker.channel()
        channel.queue_declare(name, durable=True, arguments={"x-max-length": 7})
        yield name
        broker.channel().queue_delete(name)


def _due() -> dict:
    return {"now": NOW - dt.timedelta(minutes=1),
            "schedule": {"kind": "once", "run_at": NOW.isoformat()}}  # fmt: skip


def _relay_step(now: dt.datetime, config: RelayConfig | None = None):
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        return relay_run_once(now=now, config=config or RelayConfig(), publisher=publisher)
    finally:
        publisher.close()


def _outage_step(now: dt.datetime) -> None:
    publisher = ConfirmingPublisher("amqp://guest:guest@127.0.0.1:1//", {"connect_timeout": 1})
    with pytest.raises(BROKER_ERRORS):
        relay_run_once(now=now, config=RelayConfig(), publisher=publisher)


def test_a_queue_the_broker_refuses_holds_back_only_its_own_messages(make_job, refused_queue):
    """A lasting refusal (PRECONDITION_FAILED) fails the runs only once every try for longer
    than `refusal_grace` was refused; tries that met an outage before it count nothing, and
    an outage in between starts the wait again."""
    from jobs.models import AuditEvent, RunState

    purge_queue()
    refused = make_job(queue=refused_queue, **_due())
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    for _ in range(6):  # a broker outage: six tries, none of them a refusal
        _outage_step(NOW)
    behind = [make_job(**_due()) for _ in range(3)]
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    assert sorted(OutboxMessage.objects.values_list("queue", flat=True))[-1] == refused_queue
    try:
        result = _relay_step(NOW)
        # The messages behind the refused one went out; the refused one waits, a try counted.
        assert (result.published, result.undeliverable) == (3, 0)
        assert len(_drain_queue()) == 3
        [row] = OutboxMessage.objects.all()
        assert (row.queue, row.publish_tries, row.refused_since) == (refused_queue, 7, NOW)
        assert "PRECONDITION_FAILED" in row.last_error
        # A new run behind it is not held back either.
        make_job(**_due())
        scheduler_run_once(now=NOW, config=SchedulerConfig())
        assert _relay_step(NOW).published == 1
        grace = dt.timedelta(seconds=RelayConfig().refusal_grace)
        assert _relay_step(NOW + grace / 2).undeliverable == 0
        # An outage in between: the refusals seen before it no longer count.
        _outage_step(NOW + grace / 2)
        restart = NOW + grace
        assert _relay_step(restart).undeliverable == 0
        assert _relay_step(restart + grace).undeliverable == 0
        assert OutboxMessage.objects.get().refused_since == restart
        result = _relay_step(restart + grace + dt.timedelta(seconds=1))
        assert (result.published, result.undeliverable) == (0, 1)
    finally:
        purge_queue()
    assert not OutboxMessage.objects.exists()
    run = Run.objects.get(job=refused)
    assert (run.state, run.failure_reason) == (RunState.FAILED, "undeliverable")
    event = AuditEvent.objects.get(run=run, action="run.undeliverable")
    assert "PRECONDITION_FAILED" in event.data["reason"]
    assert event.data["refused_since"] == restart.isoformat()
    assert {r.state for r in Run.objects.filter(job__in=behind)} == {RunState.QUEUED}


@pytest.fixture
def locked_queue(settings):
    """An allowed queue that another connection holds exclusive, so that the relay's
    declare is refused (405 RESOURCE_LOCKED) until that connection closes: a refusal that
    passes by itself, as a cluster's 404 for a queue whose home node restarts does.
    Yields the queue's name and a function that closes the holder's connection."""
    name = f"locked-{uuid.uuid4().hex[:8]}"
    settings.SCHEDULER_QUEUES = [*settings.SCHEDULER_QUEUES, name]
    holder = Connection(settings.CELERY_BROKER_URL)
    holder.channel().queue_declare(name, exclusive=True)
    yield name, holder.release  # the exclusive queue goes with its connection
    holder.release()
    with Connection(settings.CELERY_BROKER_URL) as broker:
        broker.channel().queue_delete(name)


def test_a_refusal_that_passes_never_fails_a_run_and_its_message_goes_once_it_clears(
    make_job, locked_queue
):
    name, release = locked_queue
    job = make_job(queue=name, **_due())
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    [run] = Run.objects.filter(job=job)
    # Far more steps than were ever allowed, over far longer than any grace.
    for step in range(8):
        result = _relay_step(NOW + dt.timedelta(hours=step))
        assert (result.published, result.undeliverable) == (0, 0)
    row = OutboxMessage.objects.get()
    assert (row.publish_tries, row.refused_since) == (8, None)
    assert "RESOURCE_LOCKED" in row.last_error
    assert Run.objects.get(id=run.id).state == "queued"

    release()  # the refusal clears: the next step declares the queue and publishes
    assert _relay_step(NOW + dt.timedelta(hours=8)).published == 1
    assert not OutboxMessage.objects.exists()
    assert [m["body"][1]["run_id"] for m in _drain_queue(name)] == [str(run.id)]


@pytest.mark.parametrize("deleted", ["queue", "queue and exchange"])
def test_a_queue_deleted_between_two_steps_loses_no_message(make_job, settings, deleted):
    """An operator deletes a queue the relay's channel declared: the next batch is routed
    nowhere, the broker returns it (mandatory) before confirming it, its rows stay, and the
    step after declares the queue again and publishes them; single messages and packs. With
    its exchange deleted too, the broker refuses the publish (404 NOT_FOUND, a refusal
    that passes): the rows stay as well, and no run fails."""
    name = f"deleted-{uuid.uuid4().hex[:8]}"
    settings.SCHEDULER_QUEUES = [*settings.SCHEDULER_QUEUES, name]
    for _ in range(2):
        make_job(queue=name, **_due())
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        assert relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher).published == 2
        assert len(_drain_queue(name)) == 2
        with Connection(settings.CELERY_BROKER_URL) as broker:
            broker.channel().queue_delete(name)
            if deleted == "queue and exchange":
                broker.channel().exchange_delete(name)
        later = [make_job(queue=name, task="tests.record_packed", **_due()) for _ in range(3)]
        later.append(make_job(queue=name, **_due()))
        scheduler_run_once(now=NOW, config=SchedulerConfig())
        expected = sorted(str(r.id) for r in Run.objects.filter(job__in=later))
        steps = [relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher)]
        errors = set(OutboxMessage.objects.values_list("publish_tries", "last_error"))
        steps += [relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher)
                  for _ in range(2)]  # fmt: skip
        messages = _drain_queue(name)
    finally:
        publisher.close()
        with Connection(settings.CELERY_BROKER_URL) as broker:
            broker.channel().queue_delete(name)
    assert [(step.published, step.undeliverable) for step in steps] == [(0, 0), (4, 0), (0, 0)]
    [(tries, error)] = errors
    assert tries == 1
    assert ("NO_ROUTE" if deleted == "queue" else "NOT_FOUND") in error
    assert not OutboxMessage.objects.exists()
    sent = [m["body"][1].get("run_ids") or [m["body"][1]["run_id"]] for m in messages]
    assert sorted(run for runs in sent for run in runs) == expected
    assert sorted(len(runs) for runs in sent) == [1, 3]


def test_the_relay_declares_the_allowed_queues_and_reports_a_refused_one(refused_queue):
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        assert queues_declare(publisher, settings.SCHEDULER_QUEUES) == [refused_queue]
    finally:
        publisher.close()


def test_a_worker_declares_the_allowed_queues_as_a_relay_does(refused_queue, caplog):
    """The worker's declaration at start (scheduler_project.celery) is queues_declare."""
    from scheduler_project.celery import declare_allowed_queues

    with caplog.at_level("ERROR", logger="dispatch.broker"):
        declare_allowed_queues(sender=None)
    refusals = [r.getMessage() for r in caplog.records if r.name == "dispatch.broker"]
    assert len(refusals) == 1
    assert f"refused to declare queue {refused_queue!r}" in refusals[0]


def test_the_depth_of_a_queue_not_declared_is_zero(tmp_path):
    """On RabbitMQ (whose refusal closes the channel: the publisher's next question opens
    it again) and on the embedded filesystem broker alike."""
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        assert publisher.queue_depth(missing) == 0
        assert publisher.queue_depth("jobs") == _queue_depth("jobs")
    finally:
        publisher.close()
    folder = tmp_path / "broker"
    folder.mkdir()
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder)}
    with Connection("filesystem://", transport_options=options) as broker:
        assert queue_depth(broker.channel(), missing) == 0


def _queue_depth(name: str) -> int:
    with Connection(settings.CELERY_BROKER_URL) as broker:
        return broker.channel().queue_declare(queue=name, passive=True).message_count


def test_a_queue_at_its_high_water_mark_holds_its_rows_and_not_the_others(make_job, settings):
    """No worker consumes: `jobs` fills to the mark (5) and stops, its rows wait pending;
    another queue's rows go all the while; room made in `jobs` is filled again."""
    other = f"other-{uuid.uuid4().hex[:8]}"
    settings.SCHEDULER_QUEUES = [*settings.SCHEDULER_QUEUES, other]
    purge_queue()
    due = {"now": NOW - dt.timedelta(minutes=1),
           "schedule": {"kind": "once", "run_at": NOW.isoformat()}}  # fmt: skip
    for _ in range(12):
        make_job(**due)
    for _ in range(4):
        make_job(queue=other, **due)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    config = RelayConfig(batch_size=3, high_water=5)
    steps = []
    try:
        for _ in range(4):
            result = relay_run_once(now=NOW, config=config, publisher=publisher)
            steps.append((result.published, result.held_back, _queue_depth("jobs")))
        # Two consumed: the next step fills the room again, and no more.
        with Connection(settings.CELERY_BROKER_URL) as broker:
            channel = broker.channel()
            assert all(channel.basic_get("jobs", no_ack=True) for _ in range(2))
        result = relay_run_once(now=NOW, config=config, publisher=publisher)
        steps.append((result.published, result.held_back, _queue_depth("jobs")))
        assert _queue_depth(other) == 4
    finally:
        publisher.close()
        purge_queue()
        with Connection(settings.CELERY_BROKER_URL) as broker:
            broker.channel().queue_delete(other)
    # (published in both queues, queues held back, ready in `jobs`)
    assert steps == [(6, 0, 3), (3, 1, 5), (0, 1, 5), (0, 1, 5), (2, 1, 5)]
    assert OutboxMessage.objects.filter(queue="jobs").count() == 12 - 7
    assert not OutboxMessage.objects.filter(queue=other).exists()


def test_a_queue_s_rows_go_by_priority_then_oldest_first(make_job):
    """`priority` (0-9) orders what waits in the outbox for a queue: the relay's claim takes
    the highest first, then the oldest; the broker's queue itself stays first in, first out."""
    purge_queue()
    due = {"now": NOW - dt.timedelta(minutes=1),
           "schedule": {"kind": "once", "run_at": NOW.isoformat()}}  # fmt: skip
    for priority in (0, 0, 5, 9, 5, 0):
        make_job(priority=priority, **due)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    rows = OutboxMessage.objects.values_list("priority", "id", "run_id")
    expected = [str(run_id) for _, _, run_id in sorted(rows, key=lambda r: (-r[0], r[1]))]
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        for _ in range(3):
            relay_run_once(now=NOW, config=RelayConfig(batch_size=2), publisher=publisher)
    finally:
        publisher.close()
    assert [m["body"][1]["run_id"] for m in _drain_queue()] == expected
    assert [priority for priority, _, _ in sorted(rows, key=lambda r: (-r[0], r[1]))] == [
        9, 5, 5, 0, 0, 0
    ]  # fmt: skip


def test_a_transport_that_cannot_count_a_queue_has_no_backpressure(tmp_path):
    """The embedded filesystem broker tells no depth: the relay publishes without a mark."""
    folder = tmp_path / "broker"
    folder.mkdir()
    publisher = ConfirmingPublisher(
        "filesystem://", {"data_folder_in": str(folder), "data_folder_out": str(folder)}
    )
    try:
        assert publisher.queue_depth("jobs") is None
    finally:
        publisher.close()


class _PublisherRacedBy(ConfirmingPublisher):
    """A relay's publisher that lets `other` (a step of another relay) run after this
    relay's claim committed and before its messages go: the instant two relays overlap."""

    def __init__(self, other) -> None:
        super().__init__(settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS)
        self.other = other

    def publish_batch_and_confirm(self, messages, **kwargs):
        if self.other is not None:
            self.other, other = None, self.other
            other()
        return super().publish_batch_and_confirm(messages, **kwargs)


def test_two_relays_never_publish_more_of_a_capped_queue_than_its_cap(make_job):
    """max_running=5, 12 runs due, no worker: relay B steps while relay A's 5 claimed rows
    are being published; B counts them, publishes none, and the broker holds 5."""
    from jobs.models import QueueControl

    purge_queue()
    QueueControl.objects.create(name="jobs", max_running=5)
    for _ in range(12):
        make_job(**_due())
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    steps = []
    publisher = _PublisherRacedBy(lambda: steps.append(_relay_step(NOW).published))
    try:
        first = relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher)
        steps.insert(0, first.published)
        steps.append(_relay_step(NOW).published)  # room is spent: nothing more
        depth = _queue_depth("jobs")
    finally:
        publisher.close()
        purge_queue()
    assert (steps, depth) == ([5, 0, 0], 5)
    assert OutboxMessage.objects.filter(queue="jobs").count() == 12 - 5


def _handed_back_while_paused(queued_run, operator, *, until) -> list:
    """Five runs due a second apart in a queue paused (until `until`); the 1st, 3rd and
    5th were published and are handed back (new rows, after those of the 2nd and 4th)."""
    from django.db import transaction

    from dispatch.queues import queue_holds_run
    from jobs.queues import queue_pause

    purge_queue()
    runs = [queued_run(run_at=NOW + dt.timedelta(seconds=n)) for n in range(5)]
    queue_pause(name="jobs", actor=operator, reason="test", until=until, now=NOW)
    for run in runs[::2]:
        OutboxMessage.objects.filter(run=run).delete()  # published: in the broker
        with transaction.atomic():
            assert queue_holds_run(run_id=str(run.id))  # delivered, handed back
    by_id = list(OutboxMessage.objects.order_by("id").values_list("run_id", flat=True))
    assert by_id == [run.id for run in (*runs[1::2], *runs[::2])]
    return runs


def _relay_publishes_in_due_order(runs: list) -> None:
    """One relay step publishes all the runs, and the broker holds them in due order."""
    try:
        assert _relay_step(NOW + dt.timedelta(seconds=10)).published == len(runs)
        published = [message["body"][1]["run_id"] for message in _drain_queue()]
    finally:
        purge_queue()
    assert published == [str(run.id) for run in runs]


def test_resume_publishes_runs_handed_back_and_runs_waiting_in_due_order(queued_run, operator):
    """Five runs due a second apart; the 1st, 3rd and 5th were published and are handed
    back by a paused queue (new rows, after those of the 2nd and 4th waiting): after the
    resume the broker holds all five in due order."""
    from jobs.queues import queue_resume

    runs = _handed_back_while_paused(queued_run, operator, until=None)
    queue_resume(name="jobs", actor=operator)
    _relay_publishes_in_due_order(runs)


def test_a_pause_that_ends_by_its_until_publishes_in_due_order_once(queued_run, operator):
    """As above, but the pause ends by its `until` (the database's clock): the relay's
    step ends it, renumbering the rows as a resume does, and the broker holds all five in
    due order; a second step ends nothing more (one audited resume)."""
    import time

    from jobs.clock import db_now
    from jobs.models import AuditEvent, QueueControl
    from jobs.queues import queue_pauses_end_expired

    until = db_now() + dt.timedelta(seconds=3)
    runs = _handed_back_while_paused(queued_run, operator, until=until)
    time.sleep(max(0.0, (until - db_now()).total_seconds()) + 0.2)
    _relay_publishes_in_due_order(runs)
    control = QueueControl.objects.get(name="jobs")
    assert (control.paused, control.paused_until) == (False, None)
    assert queue_pauses_end_expired() == []
    assert AuditEvent.objects.filter(action="queue.resumed").count() == 1
