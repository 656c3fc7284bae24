"""scheduler_runs{state} and scheduler_outbox_backlog kept by the database's statement
triggers (storage.tallies.STATE_TALLIES, installed by jobs/migrations/0002_tally_triggers):
after the real code paths, the figures a scrape reads from the tallies equal a count of the
rows; a scrape no longer counts the run table or the outbox; the migration starts the
tallies from the rows already there; a flush (TRUNCATE, as pytest-django's transactional
tests do) leaves them consistent."""

from __future__ import annotations

import datetime as dt

import pytest
from django.conf import settings
from django.core.management.color import no_style
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Count
from django.test.utils import CaptureQueriesContext

from dispatch.broker import ConfirmingPublisher
from dispatch.promoter import PromoterConfig, promoter_run_once
from dispatch.pruner import PrunerConfig, pruner_run_once
from dispatch.relay import RelayConfig, relay_run_once
from jobs.models import Job, JobState, OutboxMessage, Run, RunState, Tally, TallyDelta
from jobs.services import job_trigger
from jobs.transitions import attempt_fail, attempt_succeed, attempts_succeed, run_claim
from storage.tallies import STATE_TALLY_TRIGGERS
from tests.factories import api_run_cancel, api_run_replay, make_job, scheduler_pass
from tests.jobs.test_metrics import scrape
from tests.processes import purge_queue

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
BEFORE = ("jobs", "0001_jobs_runs_attempts")  # the tables, no trigger yet


def scraped(api) -> tuple[dict[str, float], float]:
    """(runs by state, outbox backlog) as /metrics shows them."""
    samples = scrape(api.get("/metrics").content.decode())
    runs = {state: samples[("scheduler_runs", (("state", state),))] for state in RunState.values}
    return runs, samples[("scheduler_outbox_backlog", ())]


def counted() -> tuple[dict[str, int], int]:
    """The same figures counted from the rows."""
    by_state = dict(Run.objects.values_list("state").annotate(n=Count("id")))
    runs = {state: by_state.get(state, 0) for state in RunState.values}
    return runs, OutboxMessage.objects.filter(state="pending").count()


def assert_tallied(api) -> None:
    assert scraped(api) == counted()


def due_jobs(make_job, count: int, *, max_attempts: int = 1) -> None:
    for _ in range(count):
        make_job(
            now=NOW - dt.timedelta(minutes=1),
            schedule={"kind": "once", "run_at": NOW.isoformat()},
            retry={"max_attempts": max_attempts, "initial_delay_seconds": 1},
        )


@pytest.fixture
def publisher():
    purge_queue()
    publisher = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    yield publisher
    publisher.close()
    purge_queue()


@pytest.mark.django_db
def test_the_tallies_equal_a_count_after_every_kind_of_move(make_job, api, operator_api, publisher):
    """Materializer, relay, claims, a success, a packed success, a failure with a retry and
    its promotion, a dead letter and its replay, a cancel, retention: after each, the
    scraped figures equal the rows counted."""
    assert_tallied(operator_api)
    due_jobs(make_job, 6)
    due_jobs(make_job, 1, max_attempts=2)
    scheduler_pass(NOW)  # one INSERT of 7 runs, one of 7 outbox rows
    assert (
        scraped(operator_api)
        == counted()
        == ({**dict.fromkeys(RunState.values, 0), "queued": 7}, 7)
    )
    assert relay_run_once(now=NOW, config=RelayConfig(), publisher=publisher).published == 7
    assert_tallied(operator_api)
    assert scraped(operator_api)[1] == 0

    # The run whose job allows a retry last, the others in any order.
    runs = sorted(
        Run.objects.select_related("job"), key=lambda r: r.job.spec["retry"]["max_attempts"]
    )
    attempts = [run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=60) for run in runs]
    assert_tallied(operator_api)
    assert attempt_succeed(attempt=attempts[0], now=NOW)
    assert attempts_succeed(outcomes=[(attempts[1], None), (attempts[2], None)]) == {
        attempts[1].id,
        attempts[2].id,
    }
    assert attempt_fail(attempt=attempts[3], now=NOW, error="x", retry_at=None)  # dead letter
    retry_at = NOW + dt.timedelta(seconds=1)
    assert attempt_fail(attempt=attempts[6], now=NOW, error="x", retry_at=retry_at)
    assert_tallied(operator_api)
    assert promoter_run_once(now=NOW + dt.timedelta(seconds=2), config=PromoterConfig())
    assert_tallied(operator_api)
    assert scraped(operator_api)[1] == 1  # the retry's message waits for the relay

    assert api_run_cancel(api, runs[4]).status_code == 200  # running -> cancelled
    assert api_run_replay(api, runs[3]).status_code in (200, 202)  # failed -> queued
    assert_tallied(operator_api)
    # An update that moves no run between states adds nothing (no tally row written).
    tallies = list(Tally.objects.order_by("id").values_list("id", "count"))
    deltas = TallyDelta.objects.count()
    Run.objects.update(updated_at=NOW)
    assert list(Tally.objects.order_by("id").values_list("id", "count")) == tallies
    assert TallyDelta.objects.count() == deltas

    # Retention deletes the finished runs (their jobs done), in its own statements.
    Run.objects.filter(finished_at__isnull=False).update(finished_at=NOW - dt.timedelta(days=40))
    Job.objects.filter(runs__state__in=[RunState.SUCCEEDED, RunState.CANCELLED]).update(
        state=JobState.COMPLETED
    )
    pruned = pruner_run_once(now=NOW, config=PrunerConfig(run_retention_days=30)).runs_pruned
    assert pruned >= 3
    assert_tallied(operator_api)
    runs_now, backlog = scraped(operator_api)
    assert sum(runs_now.values()) == 7 - pruned and backlog == 2


@pytest.mark.django_db
def test_a_scrape_counts_neither_the_run_table_nor_the_outbox(operator_api, queued_run):
    queued_run()
    with CaptureQueriesContext(connection) as queries:
        assert operator_api.get("/metrics").status_code == 200
    sql = [query["sql"] for query in queries.captured_queries]
    assert not [q for q in sql if 'FROM "jobs_run"' in q]
    assert not [q for q in sql if "COUNT(" in q.upper() and "dispatch_outboxmessage" in q]
    # What it reads instead: the tally rows, rolled up and pending.
    assert [q for q in sql if 'FROM "jobs_tally"' in q and "scheduler_runs" in q]


@pytest.mark.django_db
def test_the_migration_starts_the_tallies_from_the_rows_already_there(
    operator_api, queued_run, user
):
    """Runs and outbox rows written, back to 0001 (no triggers, no tallies), forward again
    (0002 the tallies): the tallies count what was there, and the triggers go on from it.
    The rows are written before going back, by the current code: later migrations add
    columns that the current code writes (the outbox's claims), and going back keeps rows."""
    queued_run(args=[0])
    for n in range(1, 4):
        job_trigger(job=make_job(user, now=NOW, args=[n]), actor=user, now=NOW)
    run = Run.objects.first()
    attempt = run_claim(run_id=run.id, worker="w", now=NOW, lease_seconds=60)
    assert attempt_succeed(attempt=attempt, now=NOW)
    # The test's transaction holds the rows' deferred foreign-key checks, which would
    # refuse the migrations' ALTER TABLE of the outbox: check them now.
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    executor = MigrationExecutor(connection)
    executor.migrate([BEFORE])
    assert not Tally.objects.filter(name__in=["scheduler_runs", "scheduler_outbox_backlog"])

    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes("jobs"))
    assert (
        scraped(operator_api)
        == counted()
        == ({**dict.fromkeys(RunState.values, 0), "queued": 3, "succeeded": 1}, 4)
    )
    queued_run(args=[4])
    assert_tallied(operator_api)
    names = [name for name, _ in STATE_TALLY_TRIGGERS]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgname = ANY(%s)", [names])
        assert cursor.fetchone()[0] == 6


@pytest.mark.django_db(transaction=True)
def test_a_flush_truncates_the_tallies_with_the_tables(operator_api, queued_run):
    """pytest-django's transactional tests end with Django's flush: one TRUNCATE of every
    table, jobs_tally included, so the tallies and the rows go to zero together (TRUNCATE
    fires no DELETE trigger)."""
    for n in range(3):
        queued_run(args=[n])
    assert scraped(operator_api)[1] == 3
    tables = connection.introspection.django_table_names(only_existing=True)
    assert {"jobs_tally", "jobs_tally_delta", "jobs_run", "dispatch_outboxmessage"} <= set(tables)
    statements = connection.ops.sql_flush(no_style(), tables)
    assert any("TRUNCATE" in s and "jobs_tally" in s and "jobs_run" in s for s in statements)
    connection.ops.execute_sql_flush(statements)
    assert not Tally.objects.exists() and not TallyDelta.objects.exists()
    assert counted() == ({state: 0 for state in RunState.values}, 0)
