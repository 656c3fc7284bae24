"""The webhook poster: posts the pending webhook deliveries, again and again until a 2xx.

`webhook_deliveries_run_once` claims a batch of due deliveries (FOR UPDATE SKIP LOCKED, so
posters on several schedulers split the work), and in that transaction moves each one's
`next_attempt_at` a lease ahead, records the attempt's start, and renders the body at its
first try (kept: every try sends the same bytes). It posts them outside any transaction,
several at once, each within `timeout`, to an address resolved and checked again
(jobs.webhooks.webhook_addresses: no loopback, private or link-local target unless
allowed) and pinned for the request. Each answer is recorded by a conditional update on the
attempt's number: a 2xx delivers it; anything else sets the next try after an exponential
backoff, until `give_up_after` has passed since the event (then `abandoned`). A poster
killed mid-post leaves the delivery's lease to end: it is posted again under the same
delivery id (at least once; receivers deduplicate by X-Scheduler-Delivery).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from urllib.parse import urlsplit

import httpx
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction

from jobs.api.jobs import JobOutput
from jobs.api.runs import RunOutput
from jobs.models import (
    Job,
    Run,
    WebhookAttempt,
    WebhookDelivery,
    WebhookDeliveryState,
)
from jobs.webhooks import WebhookAddressRefused, webhook_addresses, webhook_signature

from .config import config_require


@dataclasses.dataclass(frozen=True)
class WebhookConfig:
    batch_size: int = 16  # deliveries claimed per pass
    concurrency: int = 16  # posts in flight at once
    timeout: float = 10.0  # seconds for an answer
    retry_seconds: float = 10.0  # the first retry's wait (SCHEDULER_WEBHOOK_RETRY_SECONDS)
    max_retry_seconds: float = 3600.0  # each next wait doubles, up to this
    give_up_after: float = 3 * 86400.0  # seconds after the event: then `abandoned`
    poll_interval: float = 1.0  # the sleep when nothing is due (a NOTIFY wakes it sooner)
    allow_private: bool = False  # SCHEDULER_WEBHOOK_ALLOW_PRIVATE

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size", "concurrency"),
                       positive=("timeout", "retry_seconds", "max_retry_seconds",
                                 "give_up_after", "poll_interval"))  # fmt: skip

    @property
    def lease_seconds(self) -> float:
        """How long a claimed delivery is held: every post of the batch, with a margin (15 s
        by default: a poster killed mid-post delays its deliveries' next try that long)."""
        return math.ceil(self.batch_size / self.concurrency) * (self.timeout + 2) + 3

    def retry_wait(self, attempt: int) -> float:
        return min(self.max_retry_seconds, self.retry_seconds * 2 ** min(attempt - 1, 30))


@dataclasses.dataclass(frozen=True)
class WebhookResult:
    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    abandoned: int = 0
    batch_full: bool = False


@dataclasses.dataclass(frozen=True)
class _Claim:
    id: str
    attempt: int
    event: str
    url: str
    secret: str
    body: bytes
    created_at: dt.datetime


def webhook_deliveries_run_once(*, now: dt.datetime, config: WebhookConfig) -> WebhookResult:
    claims = _claim(now=now, config=config)
    if not claims:
        return WebhookResult()
    counts = {"delivered": 0, "retried": 0, "abandoned": 0}
    started = time.monotonic()
    with (
        httpx.Client(timeout=config.timeout, follow_redirects=False, trust_env=False) as client,
        ThreadPoolExecutor(max_workers=config.concurrency) as pool,
    ):
        posts = {pool.submit(_post, client, claim, config): claim for claim in claims}
        for done in as_completed(posts):
            status_code, error = done.result()
            at = now + dt.timedelta(seconds=time.monotonic() - started)
            counts[_record(posts[done], status_code, error, at=at, config=config)] += 1
    return WebhookResult(claimed=len(claims), batch_full=len(claims) >= config.batch_size,
                         **counts)  # fmt: skip


def _claim(*, now: dt.datetime, config: WebhookConfig) -> list[_Claim]:
    """The due deliveries, each held a lease ahead with its attempt's start recorded."""
    with transaction.atomic():
        deliveries = list(
            WebhookDelivery.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("webhook")
            .filter(state=WebhookDeliveryState.PENDING, next_attempt_at__lte=now)
            .order_by("next_attempt_at")[: config.batch_size]
        )
        if not deliveries:
            return []
        bodies = _bodies([d for d in deliveries if not d.body])
        lease_end = now + dt.timedelta(seconds=config.lease_seconds)
        for delivery in deliveries:
            delivery.body = delivery.body or bodies[delivery.id]
            delivery.attempt_count += 1
            delivery.next_attempt_at = lease_end
        WebhookDelivery.objects.bulk_update(
            deliveries, ["body", "attempt_count", "next_attempt_at"]
        )
        WebhookAttempt.objects.bulk_create(
            WebhookAttempt(delivery=d, number=d.attempt_count, started_at=now) for d in deliveries
        )
    return [
        _Claim(
            id=str(d.id),
            attempt=d.attempt_count,
            event=d.event,
            url=d.webhook.url,
            secret=d.webhook.secret,
            body=d.body.encode(),
            created_at=d.created_at,
        )  # fmt: skip
        for d in deliveries
    ]


def _bodies(deliveries: list[WebhookDelivery]) -> dict:
    """Each delivery's JSON body: its job and run as the API shows them to the job's
    owner (webhooks go to the owner's own URL), or the event's own data."""
    jobs = Job.objects.select_related("owner").in_bulk({d.job_id for d in deliveries if d.job_id})
    runs = (
        Run.objects.select_related("job_version")
        .prefetch_related("attempts")
        .in_bulk({d.run_id for d in deliveries if d.run_id})
    )
    bodies = {}
    for delivery in deliveries:
        data = dict(delivery.data or {})
        job = jobs.get(delivery.job_id)
        if delivery.job_id is not None:
            data["job"] = JobOutput(job, context={"viewer": job.owner}).data if job else None
        if delivery.run_id is not None:
            run = runs.get(delivery.run_id)
            data["run"] = RunOutput(run).data if run else None
        body = {
            "id": str(delivery.id),
            "event": delivery.event,
            "created": delivery.created_at,
            "data": data,
        }
        bodies[delivery.id] = json.dumps(body, cls=DjangoJSONEncoder, separators=(",", ":"))
    return bodies


def _post(client: httpx.Client, claim: _Claim, config: WebhookConfig) -> tuple[int | None, str]:
    """POST the delivery to the address its URL resolves to now, checked and pinned (a
    name that changed its address since the check cannot lead the post elsewhere); the
    answer's status code, or None and why there was none."""
    parts = urlsplit(claim.url)
    try:
        address = webhook_addresses(url=claim.url, allow_private=config.allow_private)[0]
    except WebhookAddressRefused as exc:
        return None, f"refused: {exc}"
    host = f"[{address}]" if ":" in address else address
    target = parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")).geturl()
    timestamp = int(time.time())
    headers = {
        "Host": parts.netloc.rsplit("@", 1)[-1],
        "Content-Type": "application/json",
        "User-Agent": "scheduler-webhooks/1",
        "X-Scheduler-Event": claim.event,
        "X-Scheduler-Delivery": claim.id,
        "X-Scheduler-Signature": webhook_signature(
            secret=claim.secret, timestamp=timestamp, body=claim.body
        ),
    }
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    try:
        response = client.post(target, content=claim.body, headers=headers,
                               extensions=extensions)  # fmt: skip
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"[:1000]
    return response.status_code, ""


def _record(
    claim: _Claim, status_code: int | None, error: str, *, at: dt.datetime, config: WebhookConfig
) -> str:
    """The attempt's answer, and what it does to the delivery (only while this attempt is
    still its latest: a poster whose lease ran out changes nothing but its attempt)."""
    delivered = status_code is not None and 200 <= status_code < 300
    if delivered:
        fields, outcome = {"state": WebhookDeliveryState.DELIVERED, "delivered_at": at}, "delivered"
    elif (at - claim.created_at).total_seconds() >= config.give_up_after:
        fields, outcome = {"state": WebhookDeliveryState.ABANDONED}, "abandoned"
    else:
        wait = dt.timedelta(seconds=config.retry_wait(claim.attempt))
        fields, outcome = {"next_attempt_at": at + wait}, "retried"
    with transaction.atomic():
        WebhookAttempt.objects.filter(delivery_id=claim.id, number=claim.attempt).update(
            finished_at=at, status_code=status_code, error=error
        )
        WebhookDelivery.objects.filter(
            id=claim.id, state=WebhookDeliveryState.PENDING, attempt_count=claim.attempt
        ).update(last_status_code=status_code, **fields)
    return outcome
