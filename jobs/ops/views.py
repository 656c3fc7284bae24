"""Operations endpoints: /healthz, /readyz, /metrics.

The probes answer anonymously with a bare status (docs/security.md); the details of
/readyz, and /metrics, are for operators (jobs.roles) or, for /metrics, a scraper's
`SCHEDULER_METRICS_TOKEN`."""

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpResponse, JsonResponse
from drf_spectacular.utils import extend_schema
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry
from rest_framework import exceptions
from rest_framework.decorators import (
    api_view,
    authentication_classes,
    permission_classes,
    throttle_classes,
)
from rest_framework.settings import api_settings

from storage.metrics import database_ping

from ..roles import IsOperatorOrMetricsToken, user_is_operator
from .metrics import DatabaseCollector


def probe(view):
    """An anonymous probe (the documented exception to "every endpoint authenticates"): no
    authentication (a stale token in a probe's headers is no reason to fail it), no
    permission, no throttle (a probe must never be refused for its rate)."""
    view = authentication_classes([])(permission_classes([])(throttle_classes([])(view)))
    return extend_schema(exclude=True)(api_view(["GET"])(view))


@probe
def healthz(request):
    """The process is up (no dependency checked): for liveness probes."""
    return JsonResponse({"status": "ok"})


@probe
def readyz(request):
    """The database and the broker answer: for readiness probes. `{"status": "ok"}` or 503
    `{"status": "unavailable"}`; an operator also gets each check, with its error."""
    checks = {}
    try:
        database_ping()
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        checks["database"] = f"error: {exc}"
    try:
        with Connection(
            settings.CELERY_BROKER_URL, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS
        ) as broker:
            broker.ensure_connection(max_retries=1, timeout=3)
        checks["broker"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        checks["broker"] = f"error: {exc}"
    ready = all(value == "ok" for value in checks.values())
    body = {"status": "ok" if ready else "unavailable"}
    if _asked_by_operator(request):
        body["checks"] = checks
    return JsonResponse(body, status=200 if ready else 503)


def _asked_by_operator(request) -> bool:
    """The probe's request carries an operator's credentials (checked here, not by the
    view: a probe authenticates nobody)."""
    for authenticator in api_settings.DEFAULT_AUTHENTICATION_CLASSES:
        try:
            found = authenticator().authenticate(request)
        except (exceptions.APIException, DatabaseError):
            return False  # a stale token, or no database to check it: the bare status
        if found is not None:
            return user_is_operator(found[0])
    return False


@extend_schema(exclude=True)  # operations, not the product API
@api_view(["GET"])
@permission_classes([IsOperatorOrMetricsToken])
def metrics(request):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
