"""/metrics (jobs.ops.metrics): the durable counters with their labels, and the histograms and
attempt counts the database's triggers keep (storage.tallies)."""

import datetime as dt

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs.models import Attempt, Run, RunState
from jobs.ops.metrics import BUCKETS
from jobs.services import run_replay_request
from jobs.transitions import attempt_fail, attempt_succeed, run_claim
from storage import tallies
from tests.factories import PINNED_NOW, make_job, scheduler_pass

STAGES = (
    "scheduler_discovery_lag_seconds",
    "scheduler_publish_lag_seconds",
    "scheduler_queue_wait_seconds",
    "scheduler_run_duration_seconds",
)


def scrape(text: str) -> dict:
    """{(sample name, labels as a sorted tuple): value} of a /metrics text."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def histogram(samples: dict, name: str) -> tuple[float, float, dict[str, float]]:
    """(count, sum, {le: cumulative count}) of one histogram."""
    buckets = {
        dict(labels)["le"]: value
        for (sample, labels), value in samples.items()
        if sample == f"{name}_bucket"
    }
    return samples[(f"{name}_count", ())], samples[(f"{name}_sum", ())], buckets


def at(seconds: float) -> dt.datetime:
    return PINNED_NOW + dt.timedelta(seconds=seconds)


def test_metrics_export_the_durable_counters_with_their_labels(operator_api):
    from jobs.counters import counter_increment

    counter_increment("scheduler_lease_expired_total", by=3)
    counter_increment("scheduler_reconcile_repairs_total", labels='kind="republished"')
    text = operator_api.get("/metrics").content.decode()
    assert "scheduler_lease_expired_total 3.0" in text
    assert 'scheduler_reconcile_repairs_total{kind="republished"} 1.0' in text


def test_histograms_and_attempts_count_each_stage_once_and_survive_pruning(
    operator_api, queued_run
):
    """Three runs with known stage times: the histograms hold exactly their observations,
    in the right buckets, and the attempt counter is not lowered by deleting the rows."""
    ran, failed, retrying = (
        queued_run(run_at=PINNED_NOW, materialize_at=at(0.02), args=[n]) for n in range(3)
    )
    attempts = {}
    for run in (ran, failed, retrying):
        attempts[run.id] = run_claim(
            run_id=run.id, worker="w", now=at(0.3), lease_seconds=300, published_at=at(0.1)
        )
    assert attempt_succeed(attempt=attempts[ran.id], now=at(1.3))
    assert attempt_fail(attempt=attempts[failed.id], now=at(3.3), error="x", retry_at=None)
    assert attempt_fail(attempt=attempts[retrying.id], now=at(0.4), error="x", retry_at=at(9))

    samples = scrape(operator_api.get("/metrics").content.decode())
    count, total, buckets = histogram(samples, "scheduler_discovery_lag_seconds")
    assert (count, buckets["0.01"], buckets["0.025"]) == (3, 0, 3)
    assert total == pytest.approx(0.06)
    count, total, buckets = histogram(samples, "scheduler_publish_lag_seconds")
    assert (count, buckets["0.05"], buckets["0.1"], buckets["+Inf"]) == (3, 0, 3, 3)
    assert total == pytest.approx(0.24)
    count, total, _ = histogram(samples, "scheduler_queue_wait_seconds")
    assert (count, total) == (3, pytest.approx(0.6))
    # Only the two runs that finished have a duration: 1 s and 3 s.
    count, total, buckets = histogram(samples, "scheduler_run_duration_seconds")
    assert (count, buckets["1.0"], buckets["2.5"], buckets["5.0"]) == (2, 1, 1, 2)
    assert total == pytest.approx(4.0)
    assert samples[("scheduler_attempts_total", (("outcome", "succeeded"),))] == 1
    assert samples[("scheduler_attempts_total", (("outcome", "failed"),))] == 2
    assert samples[("scheduler_attempts_total", (("outcome", "lost"),))] == 0

    Attempt.objects.all().delete()  # what a retention policy will do
    Run.objects.all().delete()
    after = scrape(operator_api.get("/metrics").content.decode())
    assert after[("scheduler_attempts_total", (("outcome", "failed"),))] == 2
    assert histogram(after, "scheduler_run_duration_seconds")[0] == 2


def test_a_one_time_job_dated_in_the_past_is_measured_from_its_acceptance(operator_api, user):
    """A job dated 2020 accepted at PINNED_NOW (2030) and materialized 0.5 s later: its
    run's discovery lag is 0.5 s, not ten years; the run keeps its scheduled_for."""
    run_at = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    job = make_job(user, now=PINNED_NOW, schedule={"kind": "once", "run_at": run_at.isoformat()})
    scheduler_pass(at(0.5))
    run = Run.objects.get(job=job)
    assert (run.scheduled_for, run.due_at) == (run_at, PINNED_NOW)
    samples = scrape(operator_api.get("/metrics").content.decode())
    count, total, _ = histogram(samples, "scheduler_discovery_lag_seconds")
    assert (count, total) == (1, pytest.approx(0.5))


def test_every_histogram_has_the_buckets_the_triggers_count_in(operator_api):
    assert tallies.BUCKETS == BUCKETS
    samples = scrape(operator_api.get("/metrics").content.decode())
    for name in STAGES:
        count, total, buckets = histogram(samples, name)
        assert (count, total) == (0, 0)
        assert list(buckets) == [repr(b) for b in BUCKETS] + ["+Inf"]


def test_a_job_dated_in_the_past_is_overdue_from_its_acceptance(operator_api, user):
    """Accepted 30 s ago with a run_at of 2020 and not materialized yet (no scheduler ran):
    overdue by 30 s, not by years."""
    accepted = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30)
    make_job(user, now=accepted, schedule={"kind": "once", "run_at": "2020-01-01T00:00:00Z"})
    samples = scrape(operator_api.get("/metrics").content.decode())
    assert 30 <= samples[("scheduler_oldest_overdue_seconds", ())] < 60


def test_a_run_waiting_in_the_outbox_is_overdue_from_when_it_became_publishable(operator_api, user):
    """Materialized 90 s ago, its message held back since (a full queue, an owner at its
    limit): the oldest-overdue gauge shows that wait, as the outbox's own gauge does."""
    publishable = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=90)
    make_job(user, now=publishable - dt.timedelta(minutes=1),
             schedule={"kind": "once", "run_at": publishable.isoformat()})  # fmt: skip
    scheduler_pass(publishable)
    samples = scrape(operator_api.get("/metrics").content.decode())
    assert 90 <= samples[("scheduler_oldest_overdue_seconds", ())] < 120
    assert 90 <= samples[("scheduler_outbox_oldest_pending_seconds", ())] < 120


def test_a_delivery_is_measured_without_a_statement_of_its_own(operator_api, queued_run):
    """The worker's hot path sends what it sent before the histograms (the claim, the
    success with its log manifest); the database's triggers count the run as it commits."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from dispatch.worker import run_execute_delivery

    run = queued_run()
    with CaptureQueriesContext(connection) as statements:
        outcome = run_execute_delivery(
            run_id=str(run.id), handler=lambda ctx: None, worker="w", message_id="m",
            published_at=at(0.1).isoformat(),
        )  # fmt: skip
    assert outcome["outcome"] == "succeeded"
    sent = [q["sql"] for q in statements.captured_queries if "SAVEPOINT" not in q["sql"]]
    # The claim with its queue gate (one statement), the attempt's and run's success
    # with the empty log manifest (one statement).
    assert len(sent) == 2 and not [sql for sql in sent if "jobs_tally" in sql]
    samples = scrape(operator_api.get("/metrics").content.decode())
    assert histogram(samples, "scheduler_queue_wait_seconds")[0] == 1
    assert histogram(samples, "scheduler_run_duration_seconds")[0] == 1
    assert samples[("scheduler_attempts_total", (("outcome", "succeeded"),))] == 1


def test_partition_leases_are_shown_by_holder_with_the_unheld_and_the_replicas(operator_api):
    """Live leases only (on the database's clock): an expired one counts as unheld."""
    from jobs.clock import db_now
    from jobs.models import PartitionLease, SchedulerReplica

    now = db_now()
    live, gone = now + dt.timedelta(seconds=60), now - dt.timedelta(seconds=1)
    for partition, holder, expires_at in [(0, "a", live), (1, "a", live), (2, "b", live),
                                          (3, "c", gone)]:  # fmt: skip
        PartitionLease.objects.create(
            partition=partition, holder=holder, expires_at=expires_at, acquired_at=now
        )
    SchedulerReplica.objects.create(holder="a", expires_at=live, joined_at=now)
    SchedulerReplica.objects.create(holder="b", expires_at=live, joined_at=now)
    SchedulerReplica.objects.create(holder="c", expires_at=gone, joined_at=now)

    samples = scrape(operator_api.get("/metrics").content.decode())

    leases = {
        dict(labels)["holder"]: value
        for (name, labels), value in samples.items()
        if name == "scheduler_partition_leases"
    }
    assert leases == {"a": 2, "b": 1}
    assert samples[("scheduler_partitions_unheld", ())] == 64 - 3
    assert samples[("scheduler_partition_replicas", ())] == 2


def test_the_dead_letter_counter_never_drops_when_a_failed_run_is_replayed(
    operator_api, operator, queued_run
):
    """scheduler_dead_letter_total counts runs as they end failed: a replay (failed ->
    queued) leaves it alone, the replayed run failing again adds one."""

    def dead_letters() -> float:
        return scrape(operator_api.get("/metrics").content.decode())[
            ("scheduler_dead_letter_total", ())
        ]

    run = queued_run(run_at=PINNED_NOW, materialize_at=at(0.02))
    first = run_claim(run_id=run.id, worker="w", now=at(0.3), lease_seconds=300)
    assert attempt_fail(attempt=first, now=at(1), error="x", retry_at=None)
    assert dead_letters() == 1

    assert run_replay_request(run=Run.objects.get(id=run.id), actor=operator, now=at(2))
    assert Run.objects.get(id=run.id).state == RunState.QUEUED
    assert dead_letters() == 1

    second = run_claim(run_id=run.id, worker="w", now=at(3), lease_seconds=300)
    assert attempt_fail(attempt=second, now=at(4), error="x", retry_at=None)
    assert dead_letters() == 2
