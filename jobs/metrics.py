"""/metrics: read at scrape time from the database, so every process's events are counted.

Counters come from the durable `Counter` table; gauges and the per-stage lateness are
computed from the runs of the last `LAG_WINDOW` (quantiles 0.5, 0.99 and 1).
"""

from __future__ import annotations

import datetime as dt
import re

from django.db.models import Count, DurationField, ExpressionWrapper, F, Min
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .clock import db_now
from .models import (
    Attempt,
    AttemptState,
    Counter,
    Job,
    JobState,
    OutboxMessage,
    OutboxState,
    Run,
    RunState,
)

LAG_WINDOW = dt.timedelta(minutes=10)
LAG_SAMPLE = 10_000
# name -> (help, label names). A Counter row's labels are stored as `kind="effect"`.
COUNTERS = {
    "scheduler_duplicate_deliveries_total": (
        "Deliveries refused: their run was already claimed or finished.",
        [],
    ),
    "scheduler_stale_completions_total": (
        "Completions, heartbeats or effects refused for a stale fencing token, by kind.",
        ["kind"],
    ),
    "scheduler_lease_expired_total": (
        "Attempts whose lease expired (ended lost by the reaper).",
        [],
    ),
    "scheduler_reconcile_repairs_total": (
        "Runs repaired by reconciliation, by kind: republished, orphaned_running, undeliverable.",
        ["kind"],
    ),
}
LABEL = re.compile(r'(\w+)="([^"]*)"')
STAGES = {
    "scheduler_discovery_lag_seconds": ("due_at", "created_at", "Due -> run created."),
    "scheduler_publish_lag_seconds": (
        "created_at",
        "published_at",
        "Run created -> confirmed by the broker.",
    ),
    "scheduler_queue_wait_seconds": ("published_at", "started_at", "Published -> attempt started."),
    "scheduler_run_duration_seconds": ("started_at", "finished_at", "Started -> finished."),
}


def _quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    if not values:
        return {}
    return {
        q: values[min(len(values) - 1, int(float(q) * len(values)))] for q in ("0.5", "0.99")
    } | {"1": values[-1]}


class DatabaseCollector:
    def collect(self):
        now = db_now()
        for name, (help_text, label_names) in COUNTERS.items():
            family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=label_names)
            rows = Counter.objects.filter(name=name)
            for row in rows:
                labels = dict(LABEL.findall(row.labels))
                family.add_metric([labels.get(label, "") for label in label_names], row.value)
            if not rows and not label_names:
                family.add_metric([], 0)
            yield family
        # Derived from the rows themselves (no extra write per attempt); pruning old rows
        # lowers them, which Prometheus reads as a counter reset.
        attempts = CounterMetricFamily(
            "scheduler_attempts", "Attempts finished, by outcome.", labels=["outcome"]
        )
        finished = (
            Attempt.objects.exclude(state=AttemptState.RUNNING)
            .values_list("state")
            .annotate(count=Count("id"))
        )
        for state, count in finished:
            attempts.add_metric([state], count)
        yield attempts
        yield CounterMetricFamily(
            "scheduler_dead_letter",
            "Runs that ended failed (the dead-letter view).",
            value=Run.objects.filter(state=RunState.FAILED).count(),
        )
        backlog = OutboxMessage.objects.filter(state=OutboxState.PENDING).count()
        yield GaugeMetricFamily(
            "scheduler_outbox_backlog", "Outbox rows not yet published.", value=backlog
        )
        oldest_pending = OutboxMessage.objects.filter(state=OutboxState.PENDING).aggregate(
            at=Min("created_at")
        )["at"]
        yield GaugeMetricFamily(
            "scheduler_outbox_oldest_pending_seconds",
            "Age of the oldest unpublished outbox row (alarm when it keeps growing).",
            value=max(0.0, (now - oldest_pending).total_seconds()) if oldest_pending else 0.0,
        )
        oldest = Job.objects.filter(state=JobState.ACTIVE).aggregate(at=Min("next_run_at"))["at"]
        overdue = max(0.0, (now - oldest).total_seconds()) if oldest else 0.0
        yield GaugeMetricFamily(
            "scheduler_oldest_overdue_seconds",
            "Age of the oldest due occurrence not yet materialized.",
            value=overdue,
        )
        recent = Run.objects.filter(created_at__gte=now - LAG_WINDOW)
        for name, (start, end, help_text) in STAGES.items():
            family = GaugeMetricFamily(
                name, f"{help_text} Quantiles over the last 10 minutes.", labels=["quantile"]
            )
            durations = (
                recent.filter(**{f"{start}__isnull": False, f"{end}__isnull": False})
                .annotate(lag=ExpressionWrapper(F(end) - F(start), output_field=DurationField()))
                .values_list("lag", flat=True)[:LAG_SAMPLE]
            )
            for quantile, value in _quantiles([d.total_seconds() for d in durations]).items():
                family.add_metric([quantile], value)
            yield family
        runs = GaugeMetricFamily("scheduler_runs", "Runs by state.", labels=["state"])
        counts = dict(Run.objects.values_list("state").annotate(count=Count("id")))
        for state in RunState.values:  # every state, zeros included, in one query
            runs.add_metric([state], counts.get(state, 0))
        yield runs
