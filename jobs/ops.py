"""Operations endpoints: /healthz, /readyz, /metrics."""

from django.conf import settings
from django.db import connection
from django.http import HttpResponse, JsonResponse
from drf_spectacular.utils import extend_schema
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry
from rest_framework.decorators import api_view

from .metrics import DatabaseCollector


@extend_schema(exclude=True)  # operations, not the product API
@api_view(["GET"])
def healthz(request):
    """The process is up (no dependency checked): for liveness probes (authenticated, as
    every endpoint is; probes send a token header)."""
    return JsonResponse({"status": "ok"})


@extend_schema(exclude=True)  # operations, not the product API
@api_view(["GET"])
def readyz(request):
    """The database and the broker answer: for readiness probes (authenticated)."""
    checks = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
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
    return JsonResponse(checks, status=200 if ready else 503)


@extend_schema(exclude=True)  # operations, not the product API
@api_view(["GET"])
def metrics(request):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
