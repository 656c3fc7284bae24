"""The operations endpoints (jobs.ops): /healthz, /readyz and /metrics need a token."""


def test_operations_endpoints_require_authentication(client, api):
    for url in ("/metrics", "/healthz", "/readyz"):
        assert client.get(url).status_code == 401, url
    metrics = api.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.content.decode()
    for name in (
        "scheduler_outbox_backlog",
        "scheduler_duplicate_deliveries_total",
        "scheduler_discovery_lag_seconds",
        "scheduler_oldest_overdue_seconds",
        "scheduler_outbox_oldest_pending_seconds",
        "scheduler_lease_expired_total",
        "scheduler_reconcile_repairs",
        "scheduler_stale_completions",
        "scheduler_dead_letter_total",
    ):
        assert name in text
    assert api.get("/readyz").json() == {"database": "ok", "broker": "ok"}
