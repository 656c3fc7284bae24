"""Fair shares at the relay's claim (dispatch.shares), in process against the real
database and the session's RabbitMQ vhost: owners share a step in turn, and an owner at
its limit of active runs is passed over without holding back anyone else."""

import datetime as dt

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from dispatch.broker import ConfirmingPublisher
from dispatch.promoter import PromoterConfig, promoter_run_once
from dispatch.reconciler import ReconcileConfig, ReconcileWindow, reconcile_run_once
from dispatch.relay import RelayConfig, relay_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once
from dispatch.shares import OwnerTurns, shares
from jobs.models import ActiveRun, FailureReason, OutboxMessage, OwnerLimit, Run, RunState
from jobs.services import run_replay_request
from jobs.transitions import run_give_up
from storage.shares import LIMIT_LOCK_SPACE
from tests.dispatch.test_relay import _drain_queue
from tests.processes import purge_queue

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
LAPSED = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)  # a claim that ran out (the database's clock)
DUE = {"now": NOW - dt.timedelta(minutes=1),
       "schedule": {"kind": "once", "run_at": NOW.isoformat()}}  # fmt: skip


@pytest.fixture
def relay():
    purge_queue()
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    turns = OwnerTurns()

    def step(**config):
        return relay_run_once(
            now=NOW, config=RelayConfig(**config), publisher=publisher, turns=turns
        )

    yield step
    publisher.close()
    purge_queue()


def _owners_of_published() -> list[int]:
    owner_of = dict(Run.objects.values_list("id", "job__owner_id"))
    return [owner_of[_run_id(message)] for message in _drain_queue()]


def _run_id(message):
    import uuid

    return uuid.UUID(message["body"][1]["run_id"])


def test_shares_are_equal_the_remainder_goes_in_turn_and_limits_cap_them():
    assert shares(7, ["a", "b", "c"], {"a": None, "b": None, "c": None}) == {
        "a": 3, "b": 2, "c": 2
    }  # fmt: skip
    assert shares(2, ["a", "b", "c"], {"a": None, "b": None, "c": None}) == {"a": 1, "b": 1}
    assert shares(9, ["a", "b", "c"], {"a": 1, "b": 0, "c": None}) == {"a": 1, "c": 4}
    assert shares(0, ["a"], {"a": None}) == {}


def test_owners_share_a_step_in_turn_and_a_share_unused_goes_to_the_others(
    make_job, user, other_user, relay
):
    """Ten runs of one owner and two of another, a step of six: the other's two go out
    with four of the first, one of each in turn (not the first owner's flood first)."""
    for _ in range(10):
        make_job(owner=user, **DUE)
    for _ in range(2):
        make_job(owner=other_user, **DUE)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    assert relay(batch_size=6).published == 6
    published = _owners_of_published()
    assert sorted(published) == sorted([user.id] * 4 + [other_user.id] * 2)
    assert other_user.id in published[:2] and other_user.id in published[2:4]
    assert OutboxMessage.objects.filter(owner=user).count() == 6


def test_an_owner_at_its_limit_waits_and_others_go_on(make_job, user, other_user, relay):
    OwnerLimit.objects.create(owner=user, max_active_runs=2)
    for _ in range(5):
        make_job(owner=user, **DUE)
        make_job(owner=other_user, **DUE)
    scheduler_run_once(now=NOW, config=SchedulerConfig())

    result = relay()
    assert (result.published, result.held_back) == (7, 1)
    assert ActiveRun.objects.filter(owner=user).count() == 2
    assert not ActiveRun.objects.filter(owner=other_user).exists()  # no limit: not counted
    # Its two are queued in the broker: nothing more of it, whatever the room.
    assert relay().published == 0
    # One runs, one finishes: one more may go.
    running, finished = ActiveRun.objects.filter(owner=user).values_list("run_id", flat=True)
    Run.objects.filter(id=running).update(state=RunState.RUNNING)
    Run.objects.filter(id=finished).update(state=RunState.SUCCEEDED)
    assert relay().published == 1
    assert set(ActiveRun.objects.values_list("run_id", flat=True)) == {
        running, *Run.objects.filter(job__owner=user, state=RunState.QUEUED)
        .exclude(outbox_messages__isnull=False).values_list("id", flat=True)
    }  # fmt: skip
    assert OutboxMessage.objects.filter(owner=user).count() == 2


def test_the_default_limit_holds_every_owner_but_one_an_operator_lifted(
    make_job, user, other_user, relay
):
    OwnerLimit.objects.create(owner=other_user, max_active_runs=None)
    for _ in range(3):
        make_job(owner=user, **DUE)
        make_job(owner=other_user, **DUE)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    assert relay(owner_max_active_runs=1).published == 4
    assert OutboxMessage.objects.filter(owner=user).count() == 2
    assert not OutboxMessage.objects.filter(owner=other_user).exists()


@pytest.mark.django_db(transaction=True)
def test_an_owner_another_relay_is_claiming_for_is_passed_over(make_job, user, other_user, relay):
    """Two relays must not both fill one owner's allowance: the owner's advisory lock, held
    here by another session, makes this relay pass the owner over this step."""
    OwnerLimit.objects.create(owner=user, max_active_runs=5)
    make_job(owner=user, **DUE)
    make_job(owner=other_user, **DUE)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    db = connection.settings_dict
    with psycopg.connect(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432,
                         user=db["USER"], dbname=db["NAME"], autocommit=True) as other:  # fmt: skip
        other.execute(
            "SELECT pg_advisory_lock(%s, hashtext(%s::text))", [LIMIT_LOCK_SPACE, user.id]
        )
        result = relay()
        assert (result.published, result.held_back) == (1, 1)
        assert list(OutboxMessage.objects.values_list("owner_id", flat=True)) == [user.id]
    assert relay().published == 1


def _published_again(relay, run) -> bool:
    """Three relay steps: whether the run's new outbox row went out."""
    for _ in range(3):
        relay()
    return not OutboxMessage.objects.filter(run=run).exists()


def _owner_s_published_run(make_job, user, relay) -> Run:
    """The one run of an owner limited to one active run, published: it counts."""
    OwnerLimit.objects.create(owner=user, max_active_runs=1)
    make_job(owner=user, **DUE)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    assert relay().published == 1
    run = Run.objects.get(job__owner=user)
    assert ActiveRun.objects.filter(run=run).exists()
    return run


def test_a_run_republished_by_reconciliation_does_not_count_against_its_own_publication(
    make_job, user, relay
):
    """Its message lost in the broker, the run never leaves `queued`: reconciliation writes
    a new outbox row, which the owner's limit (reached by that very run) must not hold."""
    run = _owner_s_published_run(make_job, user, relay)
    purge_queue()  # the message is lost
    later = NOW + dt.timedelta(minutes=10)
    result = reconcile_run_once(
        window=ReconcileWindow(),
        now=later,
        config=ReconcileConfig(queued_after_seconds=60),
        queue_depth=lambda _: 0,
    )
    assert result.republished == 1
    assert not ActiveRun.objects.filter(run=run).exists()
    assert _published_again(relay, run)
    assert ActiveRun.objects.filter(run=run).exists()  # counted again, once


def test_a_retried_run_does_not_count_against_its_own_publication(make_job, user, relay):
    """A run waiting for its retry is promoted back to `queued` with a new outbox row before
    any relay step saw it leave `queued`: its old count must not hold the new row."""
    run = _owner_s_published_run(make_job, user, relay)
    purge_queue()
    Run.objects.filter(id=run.id).update(state=RunState.RETRY_WAIT, next_attempt_at=NOW)
    assert promoter_run_once(now=NOW, config=PromoterConfig()).retries_queued == 1
    assert _published_again(relay, run)


def test_a_replayed_run_does_not_count_against_its_own_publication(make_job, user, relay):
    run = _owner_s_published_run(make_job, user, relay)
    purge_queue()
    assert run_give_up(run_id=run.id, now=NOW, reason=FailureReason.UNDELIVERABLE)
    run.refresh_from_db()
    assert run_replay_request(run=run, actor=user, now=NOW)
    assert _published_again(relay, run)


class _Watching(ConfirmingPublisher):
    """Publishes as a relay does; while it publishes, asks another session what it could
    take: the owner's advisory lock and the claimed rows' row locks."""

    def __init__(self, other, owner_id: int) -> None:
        super().__init__(settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS)
        self.other, self.owner_id, self.seen = other, owner_id, []

    def publish_batch_and_confirm(self, messages, **kwargs):
        free = self.other.execute(
            "SELECT pg_try_advisory_lock(%s, hashtext(%s::text))", [LIMIT_LOCK_SPACE, self.owner_id]
        ).fetchone()[0]
        if free:
            self.other.execute(
                "SELECT pg_advisory_unlock(%s, hashtext(%s::text))",
                [LIMIT_LOCK_SPACE, self.owner_id],
            )
        ids = [message.id for message in messages]
        with self.other.transaction():
            locked = len(self.other.execute(
                "SELECT id FROM dispatch_outboxmessage WHERE id = ANY(%s)"
                " FOR UPDATE SKIP LOCKED", [ids]
            ).fetchall())  # fmt: skip
        self.seen.append((free, locked == len(ids)))
        return super().publish_batch_and_confirm(messages, **kwargs)


@pytest.mark.django_db(transaction=True)
def test_a_relay_holds_no_lock_another_relay_needs_while_it_publishes(make_job, user):
    """While a relay waits for the broker, another session takes the owner's limit lock and
    every claimed row's lock at once: the claim is committed, a lease, not a lock; the
    owner's live claims count against its limit meanwhile, and the limit holds."""
    purge_queue()
    OwnerLimit.objects.create(owner=user, max_active_runs=2)
    for _ in range(3):
        make_job(owner=user, **DUE)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    db = connection.settings_dict
    with psycopg.connect(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432,
                         user=db["USER"], dbname=db["NAME"], autocommit=True) as other:  # fmt: skip
        publisher = _Watching(other, user.id)
        try:
            result = relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher)
        finally:
            publisher.close()
    assert publisher.seen == [(True, True)]
    assert (result.published, result.held_back) == (2, 1)
    assert ActiveRun.objects.filter(owner=user).count() == 2
    assert OutboxMessage.objects.filter(owner=user, claimed_by__isnull=True).count() == 1
    purge_queue()


def test_a_lapsed_claim_is_published_by_another_relay_within_the_owner_s_limit(
    make_job, user, relay
):
    """A relay froze after claiming an owner's rows: while its claim lasts they count
    against the limit and no one publishes them; once it ran out, another relay publishes
    them, and the frozen relay, waking, deletes and counts nothing."""
    import uuid

    from storage.outbox import outbox_claim_pending, outbox_delete_published

    OwnerLimit.objects.create(owner=user, max_active_runs=3)
    for _ in range(4):
        make_job(owner=user, **DUE)
    scheduler_run_once(now=NOW, config=SchedulerConfig())
    frozen = uuid.uuid4()
    claimed = outbox_claim_pending(queue="jobs", quotas={user.id: 2}, exclude=[], claim=frozen)
    assert relay().published == 1  # 2 claimed live + 1 = the limit
    assert relay().published == 0
    OutboxMessage.objects.filter(claimed_by=frozen).update(claimed_until=LAPSED)
    assert relay().published == 2
    assert not OutboxMessage.objects.filter(id__in=[row.id for row in claimed]).exists()
    assert OutboxMessage.objects.count() == 1  # the fourth waits for room
    assert ActiveRun.objects.filter(owner=user).count() == 3
    assert outbox_delete_published(message_ids=[row.id for row in claimed], claim=frozen) == []
    assert len(_drain_queue()) == 3
