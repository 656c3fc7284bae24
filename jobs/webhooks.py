"""Notifications: owners' webhooks, the deliveries of the events they subscribe to, the
signature of a request, and the rule that keeps them off private networks.

A delivery of a run's end is written by a trigger in the statement that ends the run
(storage.webhooks); the other events call `webhook_event_record` in their own transaction.
dispatch.webhooks posts the pending deliveries.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import ipaddress
import secrets
import socket
import uuid
from collections.abc import Iterable
from urllib.parse import urlsplit

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import QuerySet

from storage.webhooks import webhook_deliveries_record_for_job

from .models import (
    Webhook,
    WebhookAttempt,
    WebhookDelivery,
    WebhookDeliveryState,
    WebhookEvent,
)
from .notify import CHANNEL_WEBHOOKS, notify
from .roles import user_is_operator

PING = "ping"


class WebhookAddressRefused(ValueError):
    """The URL's host resolves to an address webhooks may not reach (or to none)."""


def webhook_addresses(*, url: str, allow_private: bool) -> list[str]:
    """The addresses `url`'s host resolves to, each allowed; WebhookAddressRefused when it
    resolves to none, or to any loopback, private, link-local, multicast, reserved or
    unspecified address while `allow_private` is false (server-side request forgery: a
    webhook must not reach the scheduler's own network)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookAddressRefused("Must be an http or https URL with a host.")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        message = f"The host {parts.hostname!r} does not resolve: {exc}."
        raise WebhookAddressRefused(message) from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not allow_private:
        for text in addresses:
            address = ipaddress.ip_address(text.split("%", 1)[0])
            if not address.is_global or address.is_multicast:
                raise WebhookAddressRefused(
                    f"The host {parts.hostname!r} resolves to {text}, a loopback, private, "
                    "link-local or reserved address; webhooks may not target those unless "
                    "SCHEDULER_WEBHOOK_ALLOW_PRIVATE=true."
                )
    if not addresses:
        raise WebhookAddressRefused(f"The host {parts.hostname!r} resolves to no address.")
    return addresses


def webhook_signature(*, secret: str, timestamp: int, body: bytes) -> str:
    """The `X-Scheduler-Signature` header: `t=<unix seconds>,v1=<hex HMAC-SHA256 of
    "<t>.<body>" keyed with the secret>`."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={digest.hexdigest()}"


def webhook_create(
    *, owner: AbstractBaseUser, url: str, events: list[str], jobs: list[uuid.UUID] | None
) -> Webhook:
    """A new webhook with a fresh secret (the caller shows it once)."""
    return Webhook.objects.create(
        owner=owner,
        url=url,
        events=list(dict.fromkeys(events)),
        jobs=None if jobs is None else list(dict.fromkeys(jobs)),
        secret="whsec_" + secrets.token_hex(32),
    )


def webhook_update(*, webhook: Webhook, fields: dict) -> Webhook:
    """Change url, events or jobs (the secret never changes)."""
    for name in ("url", "events", "jobs"):
        if name in fields:
            value = fields[name]
            if name != "url" and value is not None:
                value = list(dict.fromkeys(value))
            setattr(webhook, name, value)
    webhook.save()
    return webhook


def webhook_delete(*, webhook: Webhook) -> None:
    """Deleted with its deliveries: nothing more is posted to it."""
    webhook.delete()


def webhook_ping(*, webhook: Webhook, now: dt.datetime) -> WebhookDelivery:
    """A `ping` delivery to this webhook, posted like any other."""
    with transaction.atomic():
        delivery = WebhookDelivery.objects.create(
            webhook=webhook,
            event=PING,
            data={"webhook": {"id": str(webhook.id), "url": webhook.url}},
            created_at=now,
            next_attempt_at=now,
        )
        notify(CHANNEL_WEBHOOKS)
    return delivery


def webhook_event_record(
    *,
    event: str,
    now: dt.datetime,
    job_id: uuid.UUID | None = None,
    run_id: uuid.UUID | None = None,
    owner_ids: Iterable[int] | None = None,
    data: dict | None = None,
) -> int:
    """Record a pending delivery of `event` for every webhook subscribed to it; call it in
    the transaction of the change it reports (so none is lost and none invented). How many.

    With `job_id`: the webhooks of the job's owner naming the event and no jobs or this
    one (the rule of storage.webhooks, the one the runs' trigger follows). Without (an
    event about no one job, such as `queue.paused`): the webhooks naming the event of the
    owners `owner_ids` (None: of every owner), with `data` as the body's `data`, e.g.
    `webhook_event_record(event="queue.paused", now=now, data={"queue": {"name": name}})`.
    """
    if event not in WebhookEvent.values:
        raise ValueError(f"unknown webhook event {event!r}")
    if job_id is not None:
        return webhook_deliveries_record_for_job(event=event, job_id=job_id, run_id=run_id,
                                                 now=now)  # fmt: skip
    webhooks = Webhook.objects.filter(events__contains=[event])
    if owner_ids is not None:
        webhooks = webhooks.filter(owner_id__in=list(owner_ids))
    created = WebhookDelivery.objects.bulk_create(
        WebhookDelivery(
            webhook_id=webhook_id, event=event, data=data, created_at=now, next_attempt_at=now
        )  # fmt: skip
        for webhook_id in webhooks.values_list("id", flat=True)
    )
    if created:
        notify(CHANNEL_WEBHOOKS)
    return len(created)


def webhook_list(*, user: AbstractBaseUser) -> QuerySet[Webhook]:
    """The webhooks `user` may see: their own; every one for operators."""
    webhooks = Webhook.objects.all()
    return webhooks if user_is_operator(user) else webhooks.filter(owner=user)


def webhook_get(*, user: AbstractBaseUser, webhook_id: uuid.UUID) -> Webhook | None:
    return webhook_list(user=user).filter(id=webhook_id).first()


def webhook_delivery_list(*, webhook: Webhook) -> QuerySet[WebhookDelivery]:
    """A webhook's deliveries, each with its attempts."""
    return WebhookDelivery.objects.filter(webhook=webhook).prefetch_related("attempts")


def webhook_deliveries_prune(*, cutoff: dt.datetime, limit: int) -> int:
    """Delete up to `limit` delivered or abandoned deliveries (with their attempts) of
    events before `cutoff`; how many deliveries. Pending ones are never pruned."""
    done = [WebhookDeliveryState.DELIVERED, WebhookDeliveryState.ABANDONED]
    ids = list(
        WebhookDelivery.objects.filter(state__in=done, created_at__lt=cutoff)
        .order_by("created_at")
        .values_list("id", flat=True)[:limit]
    )
    if not ids:
        return 0
    WebhookAttempt.objects.filter(delivery_id__in=ids).delete()
    return (
        WebhookDelivery.objects.filter(id__in=ids, state__in=done)
        .delete()[1]
        .get(WebhookDelivery._meta.label, 0)
    )
