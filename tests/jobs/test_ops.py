"""The operations endpoints (jobs.ops.views): anonymous probes with a bare status, details for
operators, /metrics for operators or the scraper's SCHEDULER_METRICS_TOKEN."""

METRIC_NAMES = (
    "scheduler_outbox_backlog",
    "scheduler_duplicate_deliveries_total",
    "scheduler_discovery_lag_seconds",
    "scheduler_oldest_overdue_seconds",
    "scheduler_outbox_oldest_pending_seconds",
    "scheduler_lease_expired_total",
    "scheduler_reconcile_repairs",
    "scheduler_stale_completions",
    "scheduler_dead_letter_total",
)


def test_probes_answer_anonymously_with_a_bare_status(client, api, operator_api):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok"}
    assert api.get("/readyz").json() == {"status": "ok"}  # an owner: no details either
    assert operator_api.get("/readyz").json() == {
        "status": "ok",
        "checks": {"database": "ok", "broker": "ok"},
    }
    stale = client.get("/readyz", HTTP_AUTHORIZATION="Token " + "0" * 40)
    assert stale.json() == {"status": "ok"}


def test_readyz_says_unavailable_without_the_exception_text(client, operator_api, settings):
    settings.CELERY_BROKER_URL = "amqp://guest:hunter2@127.0.0.1:1//"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable"}
    detailed = operator_api.get("/readyz").json()
    assert detailed["status"] == "unavailable" and detailed["checks"]["database"] == "ok"
    assert detailed["checks"]["broker"].startswith("error")


def test_metrics_for_operators_or_the_metrics_token_only(client, api, operator_api, settings):
    assert client.get("/metrics").status_code == 401
    assert api.get("/metrics").status_code == 403  # an owner sees no counts across owners
    response = operator_api.get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    for name in METRIC_NAMES:
        assert name in text
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 401
    settings.SCHEDULER_METRICS_TOKEN = "s3cret"
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cre").status_code in (401, 403)


def test_schema_and_docs_authenticate_and_swagger_ui_is_served_from_our_static_files(client, api):
    from django.contrib.staticfiles import finders

    assert client.get("/api/schema/").status_code == 401
    assert client.get("/api/docs/").status_code == 302  # to the login page
    assert api.get("/api/schema/").status_code == 200
    page = api.get("/api/docs/").content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in page
    assert "cdn" not in page.lower() and "https://" not in page
    assert finders.find("drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
