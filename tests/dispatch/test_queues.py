"""Queue controls without processes: the API (operators only, bad input 400), the claim's
gate (a paused or full queue's run goes back to wait, no attempt charged), the relay's
room (a paused queue is passed over, a capped one gets what its cap leaves) and the
token bucket shared by every relay."""

import datetime as dt

import pytest
from django.db import transaction

from dispatch.queues import QueueRoom, queue_holds_run, queue_of_lane
from jobs.models import AuditEvent, OutboxMessage, QueueControl, RunState
from jobs.queues import RateLimitInvalid, rate_limit_parse
from storage.queues import queue_token_take
from tests.factories import claim

pytestmark = pytest.mark.django_db


def test_rates_parse_to_a_rate_a_second_and_a_one_second_burst():
    assert rate_limit_parse("100/s") == (100.0, 100.0)
    assert rate_limit_parse("6000/min") == (100.0, 100.0)
    assert rate_limit_parse("60/hour") == (1 / 60, 1.0)
    for bad in ("fast", "0/s", "10/fortnight", ""):
        with pytest.raises(RateLimitInvalid):
            rate_limit_parse(bad)


def test_lanes_belong_to_their_queue():
    assert queue_of_lane("jobs.backfill") == "jobs"
    assert queue_of_lane("jobs.manual") == "jobs"
    assert queue_of_lane("jobs.replay") == "jobs"
    assert queue_of_lane("jobs") == "jobs"


def test_operators_pause_resume_and_limit_a_queue(operator_api, operator, api):
    listed = operator_api.get("/api/v1/queues/").json()["results"]
    assert [q["name"] for q in listed] == ["jobs", "jobs.backfill", "jobs.manual", "jobs.replay"]
    assert not listed[0]["paused"] and listed[0]["max_running"] is None
    assert api.get("/api/v1/queues/").status_code == 403
    assert api.post("/api/v1/queues/jobs/pause/", {}, format="json").status_code == 403
    until = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
    answer = operator_api.post("/api/v1/queues/jobs/pause/", {"reason": "db migration",
                               "until": until}, format="json")  # fmt: skip
    assert answer.status_code == 200, answer.content
    assert all(q["paused"] for q in answer.json()["results"])  # its lanes too
    assert AuditEvent.objects.filter(action="queue.paused", actor=operator).exists()
    answer = operator_api.post("/api/v1/queues/jobs/resume/", {}, format="json")
    assert not any(q["paused"] for q in answer.json()["results"])
    answer = operator_api.patch("/api/v1/queues/jobs/", {"max_running": 5,
                                "rate_limit": "6000/min"}, format="json")  # fmt: skip
    assert answer.status_code == 200, answer.content
    assert answer.json()["results"][0]["max_running"] == 5
    assert answer.json()["results"][0]["rate_limit"] == "6000/min"
    control = QueueControl.objects.get(name="jobs")
    assert control.rate_per_second == 100.0 and control.tokens == 100.0
    answer = operator_api.patch("/api/v1/queues/jobs/", {"rate_limit": None}, format="json")
    assert answer.json()["results"][0]["rate_limit"] is None
    for body, field in (({"max_running": 0}, "max_running"), ({"rate_limit": "lots"},
                        "rate_limit"), ({"max_runing": 3}, "max_runing")):  # fmt: skip
        answer = operator_api.patch("/api/v1/queues/jobs/", body, format="json")
        assert answer.status_code == 400 and field in answer.json(), answer.content
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).isoformat()
    answer = operator_api.post("/api/v1/queues/jobs/pause/", {"until": past}, format="json")
    assert answer.status_code == 400 and "until" in answer.json()
    assert operator_api.post("/api/v1/queues/nope/pause/", {}, format="json").status_code == 404


def _pause(name="jobs", until=None):
    QueueControl.objects.update_or_create(name=name, defaults={"paused": True,
                                          "paused_until": until})  # fmt: skip


def test_a_delivered_run_of_a_paused_queue_goes_back_to_wait_uncharged(queued_run):
    run = queued_run()
    OutboxMessage.objects.filter(run=run).delete()  # published: in the broker
    _pause()
    with transaction.atomic():
        assert queue_holds_run(run_id=str(run.id))
    run.refresh_from_db()
    assert run.state == RunState.QUEUED and run.attempt_count == 0
    assert OutboxMessage.objects.filter(run=run).count() == 1
    with transaction.atomic():  # delivered again (a redelivery): still one row
        assert queue_holds_run(run_id=str(run.id))
    assert OutboxMessage.objects.filter(run=run).count() == 1


def test_a_run_handed_back_while_its_row_is_being_published_gets_a_row_of_its_own(queued_run):
    """The relay's claimed row goes once the broker confirms it; the message handed back
    may be that very one, so the hand-back writes a row that outlives the relay's step."""
    import uuid

    run = queued_run()
    OutboxMessage.objects.filter(run=run).update(
        claimed_by=uuid.uuid4(), claimed_until=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
    )
    _pause()
    with transaction.atomic():
        assert queue_holds_run(run_id=str(run.id))
    OutboxMessage.objects.filter(run=run, claimed_by__isnull=False).delete()  # confirmed
    assert OutboxMessage.objects.filter(run=run, state="pending").count() == 1


def test_a_pause_with_an_until_in_the_past_holds_nothing(queued_run):
    run = queued_run()
    _pause(until=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
    with transaction.atomic():
        assert not queue_holds_run(run_id=str(run.id))
    assert QueueRoom().room("jobs") == float("inf")


def test_a_full_queue_holds_its_next_run_back(queued_run):
    first, second = queued_run(), queued_run()
    QueueControl.objects.create(name="jobs", max_running=1)
    claim(first)
    assert QueueRoom().room("jobs.manual") == 0  # its lanes share the cap
    with transaction.atomic():
        assert queue_holds_run(run_id=str(second.id))
    second.refresh_from_db()
    assert second.attempt_count == 0


def test_a_paused_queue_has_no_room_at_the_relay():
    _pause()
    assert QueueRoom().room("jobs") == 0 and QueueRoom().room("jobs.backfill") == 0
    assert QueueRoom().room("other") == float("inf")


def test_the_bucket_gives_one_burst_then_says_when_the_next_token_is_due():
    QueueControl.objects.create(name="jobs", rate_limit="2/s", rate_per_second=2.0,
                                burst=2.0, tokens=2.0)  # fmt: skip
    with transaction.atomic():
        assert queue_token_take(queue="jobs") == 0.0
        assert queue_token_take(queue="jobs") == 0.0
        wait = queue_token_take(queue="jobs")
    assert 0.3 < wait <= 0.5
    assert queue_token_take(queue="other") == 0.0  # no rate: never waits


def test_the_admin_pauses_and_resumes_queues_and_metrics_show_it(client, operator):
    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    page = client.get("/admin/jobs/queuecontrol/")
    assert page.status_code == 200 and b"jobs" in page.content
    answer = client.post("/admin/jobs/queuecontrol/", {"action": "pause_queues",
                         "_selected_action": ["jobs"]})  # fmt: skip
    assert answer.status_code == 302
    assert QueueControl.objects.get(name="jobs").paused
    metrics = client.get("/metrics").content.decode()
    assert 'scheduler_queue_paused{queue="jobs"} 1.0' in metrics
    assert b"paused" in client.get("/dashboard/panel/").content
    client.post("/admin/jobs/queuecontrol/", {"action": "resume_queues",
                "_selected_action": ["jobs"]})  # fmt: skip
    assert not QueueControl.objects.get(name="jobs").paused
    assert 'scheduler_queue_paused{queue="jobs"} 0.0' in client.get("/metrics").content.decode()


def test_pausing_a_queue_tells_the_webhooks_that_asked_once(operator_api, user):
    from jobs.models import Webhook, WebhookDelivery

    Webhook.objects.create(owner=user, url="https://hooks.example.com/", secret="whsec_q",
                           events=["queue.paused"])  # fmt: skip
    for reason in ("db migration", "still migrating"):  # the second changes only the reason
        answer = operator_api.post("/api/v1/queues/jobs/pause/", {"reason": reason}, format="json")
        assert answer.status_code == 200, answer.content
    (delivery,) = WebhookDelivery.objects.all()
    assert delivery.event == "queue.paused"
    assert delivery.data["queue"] == {"name": "jobs", "reason": "db migration",
                                      "until": None}  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_a_pause_ended_by_its_until_is_ended_once_by_two_relays_at_once(operator):
    """Two relays notice the same expired pause at once: the second waits for the first's
    conditional update, then finds nothing to end (one resume, one renumbering)."""
    from jobs.clock import db_now
    from jobs.queues import queue_pause, queue_pauses_end_expired
    from storage.queues import queues_pause_expired_end
    from tests.threads import in_thread, wait_for_lock_waiters

    past = db_now() - dt.timedelta(seconds=1)
    queue_pause(name="jobs", actor=operator, reason="test", until=past, now=past)
    ended: list = []
    errors: list = []
    with transaction.atomic():
        assert queues_pause_expired_end() == ["jobs"]  # the first relay, not yet committed
        other = in_thread(lambda: ended.append(queue_pauses_end_expired()), errors)
        wait_for_lock_waiters(1)
    other.join(20)
    assert errors == [] and ended == [[]]
    assert not QueueControl.objects.get(name="jobs").paused
    assert queue_pauses_end_expired() == []
