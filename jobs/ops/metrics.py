"""/metrics: read at scrape time from the database, so every process's events are counted.

Counters come from the durable `Counter` table; the stage lags, the run duration and the
attempts by outcome from the tallies the database's triggers keep as the events commit
(storage.metrics.tallies_sum reads them), so they are histograms and counters that pruning
never lowers. The runs by state and the outbox backlog are tallies too
(jobs.selectors.runs_by_state_and_backlog), so a scrape costs the same however many runs
are kept; the other gauges are computed from a few rows by index.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict

from django.conf import settings
from django.db.models import Count
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from storage import tallies
from storage.metrics import tallies_sum

from ..clock import CLOCK_SKEW_EXPIRY, db_now
from ..models import (
    AttemptState,
    Counter,
    PartitionLease,
    ProcessClock,
    QueueControl,
    RunState,
    SchedulerReplica,
)
from ..queues import queue_paused_now
from ..selectors import (
    LABEL,
    dead_letters_total,
    oldest_overdue_seconds,
    oldest_pending_outbox,
    runs_by_state_and_backlog,
)

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
    "scheduler_runs_handed_back_total": (
        "Delivered runs handed back to wait in PostgreSQL, no attempt charged, by queue and"
        " reason: paused, max_running.",
        ["queue", "reason"],
    ),
    "scheduler_reconcile_repairs_total": (
        "Runs repaired by reconciliation, by kind: republished, orphaned_running, undeliverable.",
        ["kind"],
    ),
}
# The buckets (upper bounds, seconds) storage.tallies' triggers count in: exported even
# while empty, so every histogram has the same series from its first scrape.
BUCKETS = tallies.BUCKETS
STAGES = {
    "scheduler_discovery_lag_seconds": (
        "Due (or accepted, if later) -> run created queued, or released by the promoter."
    ),
    "scheduler_publish_lag_seconds": "Run publishable -> confirmed by the broker.",
    "scheduler_queue_wait_seconds": "Published -> first attempt started.",
    "scheduler_run_duration_seconds": "First attempt started -> run finished.",
}


def _histograms() -> dict[str, tuple[list[tuple[str, float]], float]]:
    """Stage name -> (cumulative (le, count) buckets ending with +Inf, sum)."""
    buckets: dict[str, dict[float, int]] = defaultdict(dict)
    sums: dict[str, float] = defaultdict(float)
    for name, labels, count, total in tallies_sum(names=list(STAGES)):
        buckets[name][float(dict(LABEL.findall(labels))["le"])] = count
        sums[name] += total
    exported = {}
    for name in STAGES:
        cumulative, running = [], 0
        for le in sorted(buckets[name].keys() | {*BUCKETS, float("inf")}):
            running += buckets[name].get(le, 0)
            cumulative.append(("+Inf" if le == float("inf") else repr(le), running))
        exported[name] = (cumulative, sums[name])
    return exported


def _partition_families(now: dt.datetime):
    """The partition leases by holder, the partitions nobody holds, the live scheduler
    replicas: a few rows each (as many as partitions and replicas)."""
    partitions = settings.SCHEDULER_PARTITIONS
    held = dict(
        PartitionLease.objects.filter(expires_at__gte=now, partition__lt=partitions)
        .values_list("holder")
        .annotate(count=Count("partition"))
    )
    replicas = SchedulerReplica.objects.filter(expires_at__gte=now).count()
    leases = GaugeMetricFamily(
        "scheduler_partition_leases",
        "Partitions whose lease each scheduler replica holds (holder: host:pid:suffix).",
        labels=["holder"],
    )
    for holder, count in sorted(held.items()):
        leases.add_metric([holder], count)
    yield leases
    yield GaugeMetricFamily(
        "scheduler_partitions_unheld",
        "Partitions whose lease no live replica holds: their due work waits meanwhile.",
        value=partitions - sum(held.values()),
    )
    yield GaugeMetricFamily(
        "scheduler_partition_replicas",
        "Scheduler replicas sharing the partitions (their membership not expired).",
        value=replicas,
    )


def _queues_paused(now: dt.datetime) -> GaugeMetricFamily:
    """1 for each configured queue paused now (its lanes with it), else 0."""
    paused = GaugeMetricFamily(
        "scheduler_queue_paused", "1 while the queue (and its lanes) is paused.", labels=["queue"]
    )
    controls = {c.name: c for c in QueueControl.objects.filter(name__in=settings.SCHEDULER_QUEUES)}
    for queue in settings.SCHEDULER_QUEUES:
        paused.add_metric([queue], 1 if queue_paused_now(controls.get(queue), now=now) else 0)
    return paused


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
        attempts = CounterMetricFamily(
            "scheduler_attempts", "Attempts finished, by outcome.", labels=["outcome"]
        )
        finished = {
            tally.labels: tally.count for tally in tallies_sum(names=["scheduler_attempts_total"])
        }
        for state in AttemptState.values:
            if state != AttemptState.RUNNING:
                attempts.add_metric([state], finished.get(f'outcome="{state}"', 0))
        yield attempts
        runs_by_state, backlog = runs_by_state_and_backlog()
        yield CounterMetricFamily(
            "scheduler_dead_letter",
            "Times a run ended failed (the dead-letter view), replayed and pruned ones included.",
            value=dead_letters_total(),
        )
        yield GaugeMetricFamily(
            "scheduler_outbox_backlog", "Outbox rows not yet published.", value=backlog
        )
        oldest_pending = oldest_pending_outbox().first()
        yield GaugeMetricFamily(
            "scheduler_outbox_oldest_pending_seconds",
            "Age of the oldest unpublished outbox row (alarm when it keeps growing).",
            value=max(0.0, (now - oldest_pending).total_seconds()) if oldest_pending else 0.0,
        )
        yield GaugeMetricFamily(
            "scheduler_oldest_overdue_seconds",
            "Age of the oldest due work not yet in the broker: an occurrence not materialized "
            "(from acceptance, if later) or a run waiting in the outbox.",
            value=oldest_overdue_seconds(now=now, oldest_pending=oldest_pending),
        )
        for name, (buckets, total) in _histograms().items():
            yield HistogramMetricFamily(name, STAGES[name], buckets=buckets, sum_value=total)
        skews = GaugeMetricFamily(
            "scheduler_clock_skew_seconds",
            "This process's clock minus the database's, as each process measured it last.",
            labels=["host", "pid", "kind", "name"],
        )
        live = ProcessClock.objects.filter(measured_at__gte=now - CLOCK_SKEW_EXPIRY)
        for host, pid, kind, name, skew in live.values_list(
            "host", "pid", "kind", "name", "skew_seconds"
        ):
            skews.add_metric([host, str(pid), kind, name], skew)
        yield skews
        runs = GaugeMetricFamily("scheduler_runs", "Runs by state.", labels=["state"])
        for state in RunState.values:  # every state, zeros included
            runs.add_metric([state], runs_by_state.get(state, 0))
        yield runs
        yield from _partition_families(now)
        yield _queues_paused(now)
