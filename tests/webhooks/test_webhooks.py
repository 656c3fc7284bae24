"""Webhooks in one process: the API (the secret once, SSRF refusals, visibility), the
deliveries written with a run's end, and the poster against a real receiver on loopback."""

from __future__ import annotations

import datetime as dt

import pytest

from dispatch.webhooks import WebhookConfig, webhook_deliveries_run_once
from jobs.models import FailureReason, Webhook, WebhookDelivery, WebhookDeliveryState
from jobs.transitions import attempt_fail, attempt_succeed
from jobs.webhooks import webhook_event_record
from tests import factories
from tests.webhooks.receiver import Receiver, documented_verify

pytestmark = pytest.mark.django_db

ALLOW = WebhookConfig(allow_private=True, retry_seconds=1.0)


def _webhook(owner, url="http://127.0.0.1:9/hook", events=("run.failed",), jobs=None):
    return Webhook.objects.create(owner=owner, url=url, events=list(events), jobs=jobs,
                                  secret="whsec_test")  # fmt: skip


def _fail(run, *, reason=FailureReason.EXHAUSTED):
    attempt = factories.claim(run)
    assert attempt_fail(attempt=attempt, now=factories.later(1), error="boom", retry_at=None,
                        reason=reason)  # fmt: skip


def test_creation_shows_the_secret_once(api, settings):
    settings.SCHEDULER_WEBHOOK_ALLOW_PRIVATE = True
    body = {"url": "http://127.0.0.1:8080/hook", "events": ["run.failed", "run.succeeded"]}
    created = api.post("/api/v1/webhooks/", body, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["secret"].startswith("whsec_")
    assert created.json()["jobs"] is None
    hook = created.json()["id"]
    for answer in (api.get(f"/api/v1/webhooks/{hook}/"), api.get("/api/v1/webhooks/")):
        assert answer.status_code == 200 and "secret" not in answer.content.decode()
    changed = api.patch(f"/api/v1/webhooks/{hook}/", {"events": ["run.failed"]}, format="json")
    assert changed.json()["events"] == ["run.failed"] and "secret" not in changed.json()


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1/", "http://localhost:8000/x", "http://10.1.2.3/", "http://[::1]/",
     "http://169.254.169.254/latest/meta-data/", "http://192.168.0.1/", "ftp://example.com/"],
)  # fmt: skip
def test_private_targets_are_refused_unless_allowed(api, settings, url):
    settings.SCHEDULER_WEBHOOK_ALLOW_PRIVATE = False
    answer = api.post("/api/v1/webhooks/", {"url": url, "events": ["run.failed"]}, format="json")
    assert answer.status_code == 400 and "url" in answer.json(), answer.content
    assert not Webhook.objects.exists()


def test_bad_input_names_the_field(api, other_user, settings):
    settings.SCHEDULER_WEBHOOK_ALLOW_PRIVATE = True
    foreign = factories.make_job(other_user)
    for body, field in (
        ({"url": "http://127.0.0.1/", "events": ["run.exploded"]}, "events"),
        ({"url": "http://127.0.0.1/", "events": []}, "events"),
        ({"url": "http://127.0.0.1/", "events": ["run.failed"], "jobs": [str(foreign.id)]},
         "jobs"),
        ({"events": ["run.failed"]}, "url"),
    ):  # fmt: skip
        answer = api.post("/api/v1/webhooks/", body, format="json")
        assert answer.status_code == 400 and field in answer.json(), answer.content
    assert not Webhook.objects.exists()


def test_others_webhooks_are_not_found(api, other_user):
    hook = _webhook(other_user)
    for method in ("get", "patch", "delete"):
        assert getattr(api, method)(f"/api/v1/webhooks/{hook.id}/").status_code == 404
    assert api.post(f"/api/v1/webhooks/{hook.id}/test/").status_code == 404
    assert api.get("/api/v1/webhooks/").json()["results"] == []


def test_a_runs_end_writes_the_deliveries_of_its_subscribers(user, other_user, queued_run):
    everything = _webhook(user, events=["run.failed", "run.undeliverable", "run.succeeded"])
    failures = _webhook(user, events=["run.failed"])
    _webhook(other_user, events=["run.failed", "run.succeeded"])  # another owner's
    failed, succeeded = queued_run(), queued_run()
    only_other = _webhook(user, events=["run.failed"], jobs=[succeeded.job_id])
    _fail(failed)
    attempt_succeed(attempt=factories.claim(succeeded), now=factories.later(1))
    rows = set(WebhookDelivery.objects.values_list("webhook_id", "event", "run_id"))
    assert rows == {
        (everything.id, "run.failed", failed.id),
        (failures.id, "run.failed", failed.id),
        (everything.id, "run.succeeded", succeeded.id),
    }
    assert not WebhookDelivery.objects.filter(webhook=only_other).exists()


def test_an_undeliverable_run_is_its_own_event(user, queued_run):
    hook = _webhook(user, events=["run.failed", "run.undeliverable"])
    _fail(queued_run(), reason=FailureReason.UNDELIVERABLE)
    assert list(WebhookDelivery.objects.values_list("webhook_id", "event")) == [
        (hook.id, "run.undeliverable")
    ]


def test_a_pause_after_failures_is_told(user):
    from jobs.models import Job, Run

    hook = _webhook(user, events=["job.paused_after_failures"])
    now = factories.PINNED_NOW
    job = factories.make_job(user, now=now, schedule={"kind": "interval", "every_seconds": 60},
                             pause_after_failures=1)  # fmt: skip
    factories.scheduler_pass(now)
    _fail(Run.objects.get(job=job, scheduled_for=now))
    assert factories.scheduler_pass(now + dt.timedelta(minutes=1)).jobs_paused == 1
    assert Job.objects.get(id=job.id).state == "paused"
    assert list(WebhookDelivery.objects.values_list("webhook_id", "event", "job_id")) == [
        (hook.id, "job.paused_after_failures", job.id)
    ]


def test_an_event_about_no_job_reaches_its_subscribers(user, other_user):
    hook = _webhook(user, events=["queue.paused"])
    _webhook(other_user, events=["run.failed"])
    now = factories.PINNED_NOW
    data = {"queue": {"name": "jobs"}}
    assert webhook_event_record(event="queue.paused", now=now, data=data) == 1
    assert WebhookDelivery.objects.get().webhook_id == hook.id


def test_the_poster_signs_retries_and_delivers(user, queued_run):
    verify = documented_verify()
    with Receiver() as receiver:
        hook = _webhook(user, url=receiver.url)
        run = queued_run()
        _fail(run)
        receiver.failing.set()
        now = dt.datetime.now(dt.UTC)
        result = webhook_deliveries_run_once(now=now, config=ALLOW)
        assert (result.claimed, result.retried) == (1, 1)
        delivery = WebhookDelivery.objects.get()
        assert delivery.state == WebhookDeliveryState.PENDING
        assert delivery.last_status_code == 500
        assert delivery.next_attempt_at >= now + dt.timedelta(seconds=1)
        # Not due yet; then due, and the receiver answers.
        assert webhook_deliveries_run_once(now=now, config=ALLOW).claimed == 0
        receiver.failing.clear()
        later = now + dt.timedelta(seconds=5)
        assert webhook_deliveries_run_once(now=later, config=ALLOW).delivered == 1
        delivery.refresh_from_db()
        assert delivery.state == WebhookDeliveryState.DELIVERED
        assert [(a.number, a.status_code) for a in delivery.attempts.order_by("number")] == [
            (1, 500), (2, 200)
        ]  # fmt: skip
    first, second = receiver.requests
    assert first["body"] == second["body"]  # the same bytes at every try
    for request in receiver.requests:
        headers = request["headers"]
        assert headers["X-Scheduler-Event"] == "run.failed"
        assert headers["X-Scheduler-Delivery"] == str(delivery.id)
        assert verify(hook.secret, request["body"], headers["X-Scheduler-Signature"])
        assert not verify("whsec_other", request["body"], headers["X-Scheduler-Signature"])
    body = first["json"]
    assert (body["id"], body["event"]) == (str(delivery.id), "run.failed")
    assert body["data"]["run"]["id"] == str(run.id)
    assert body["data"]["run"]["state"] == "failed"
    assert body["data"]["job"]["id"] == str(run.job_id)


def test_the_poster_refuses_private_addresses_at_delivery(api, user, settings):
    with Receiver() as receiver:
        _webhook(user, url=receiver.url)  # allowed once, say, and then no longer
        factories.api_client(user)
        hook = Webhook.objects.get()
        assert api.post(f"/api/v1/webhooks/{hook.id}/test/").status_code == 202
        now = dt.datetime.now(dt.UTC)
        refused = WebhookConfig(allow_private=False)
        assert webhook_deliveries_run_once(now=now, config=refused).retried == 1
        assert receiver.requests == []
        [delivery] = api.get(f"/api/v1/webhooks/{hook.id}/deliveries/").json()["results"]
        assert delivery["event"] == "ping" and delivery["next_retry_at"]
        assert "loopback" in delivery["attempts"][0]["error"]


def test_a_delivery_is_abandoned_after_the_retry_window(user, queued_run):
    _webhook(user, url="http://127.0.0.1:9/hook")  # nothing listens there
    _fail(queued_run())
    delivery = WebhookDelivery.objects.get()
    later = delivery.created_at + dt.timedelta(days=3, seconds=1)
    assert webhook_deliveries_run_once(now=later, config=ALLOW).abandoned == 1
    delivery.refresh_from_db()
    assert delivery.state == WebhookDeliveryState.ABANDONED


def test_the_pruner_deletes_finished_deliveries_past_retention(user, queued_run):
    from dispatch.pruner import PrunerConfig, pruner_run_once

    hook = _webhook(user)
    old = factories.PINNED_NOW - dt.timedelta(days=40)
    for state in ("delivered", "abandoned", "pending"):
        WebhookDelivery.objects.create(webhook=hook, event="run.failed", state=state,
                                       created_at=old)  # fmt: skip
    WebhookDelivery.objects.create(webhook=hook, event="run.failed", state="delivered",
                                   created_at=factories.PINNED_NOW)  # fmt: skip
    config = PrunerConfig(run_retention_days=30)
    assert pruner_run_once(now=factories.PINNED_NOW, config=config).webhook_deliveries_pruned == 2
    assert sorted(WebhookDelivery.objects.values_list("state", flat=True)) == [
        "delivered", "pending"
    ]  # fmt: skip


def test_the_admin_shows_deliveries_and_attempts_never_the_secret(client, user, queued_run):
    hook = _webhook(user, url="http://127.0.0.1:9/hook")  # nothing listens there
    _fail(queued_run())
    webhook_deliveries_run_once(now=dt.datetime.now(dt.UTC), config=ALLOW)
    delivery = WebhookDelivery.objects.get()
    client.force_login(factories.superuser("admin"))
    listed = client.get("/admin/jobs/webhookdelivery/")
    assert listed.status_code == 200 and str(delivery.id) in listed.content.decode()
    page = client.get(f"/admin/jobs/webhookdelivery/{delivery.id}/change/").content.decode()
    assert "ConnectError" in page  # the attempt's error, inline
    page = client.get(f"/admin/jobs/webhook/{hook.id}/change/").content.decode()
    assert hook.url in page and hook.secret not in page
