"""/metrics (jobs.metrics): the durable counters, with their labels."""


def test_metrics_export_the_durable_counters_with_their_labels(operator_api):
    from jobs.counters import counter_increment

    counter_increment("scheduler_lease_expired_total", by=3)
    counter_increment("scheduler_reconcile_repairs_total", labels='kind="republished"')
    text = operator_api.get("/metrics").content.decode()
    assert "scheduler_lease_expired_total 3.0" in text
    assert 'scheduler_reconcile_repairs_total{kind="republished"} 1.0' in text
