"""The indexes the migrations leave on the hot tables: the constraints every guarantee
rests on are there, and the indexes no query needs are not (each costs every run version)."""

import pytest
from django.db import connection


def _indexes(table: str) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s", [table])
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.django_db
def test_the_guarantees_indexes_stay_and_the_unneeded_ones_are_gone():
    runs, attempts = _indexes("jobs_run"), _indexes("jobs_attempt")
    assert {"jobs_run_idempotency_key_key", "run_one_per_occurrence",
            "run_one_backfill_per_occurrence", "run_job_idx"} <= runs  # fmt: skip
    assert {"attempt_one_running", "attempt_number_unique", "attempt_token_unique"} <= attempts
    assert not {"jobs_run_idempotency_key_7ea90ab1_like", "jobs_run_job_id_f26ec71d"} & runs
    assert "jobs_attempt_run_id_c006c626" not in attempts


# The indexes 0013 drops: no query reads them (docs/scale.md, "The hot tables' indexes").
UNREAD = {"jobs_run": "jobs_run_job_version_id_d01dae9b",
          "dispatch_outboxmessage": "dispatch_outboxmessage_message_id_key"}  # fmt: skip


@pytest.mark.django_db
def test_no_index_on_a_runs_version_or_an_outbox_rows_message_id():
    """Every version of a run and every outbox row's insert and claim would write them."""
    for table, index in UNREAD.items():
        assert index not in _indexes(table)


@pytest.mark.django_db(transaction=True)
def test_the_index_review_migration_goes_back_and_forth():
    """0013 drops the two indexes without touching the run's foreign key, and going back
    builds them again."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    executor.migrate([("jobs", "0012_run_replayed_at")])
    try:
        for table, index in UNREAD.items():
            assert index in _indexes(table)
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes("jobs"))
    for table, index in UNREAD.items():
        assert index not in _indexes(table)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'jobs_run'::regclass"
            " AND contype = 'f' AND confrelid = 'jobs_jobversion'::regclass"
        )
        assert cursor.fetchone()[0] == 1


@pytest.mark.django_db
def test_the_migrations_install_storages_triggers_and_no_other():
    """Every trigger of the project is one of storage's Ddl values (storage.tallies,
    storage.completion, storage.dependencies), installed by the migrations."""
    from storage.tallies import STATE_TALLY_TRIGGERS

    expected = {"run_measure_insert", "run_measure_update", "attempt_measure_finish",
                "run_failed_dead_letter",
                "run_ended_completes_job", "run_ended_notifies", "run_ended_signals_dependents",
                "run_created_ended_signals_dependents",
                *(name for name, _ in STATE_TALLY_TRIGGERS)}  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")
        assert {row[0] for row in cursor.fetchall()} == expected
        cursor.execute(
            "SELECT column_default FROM information_schema.columns"
            " WHERE table_name = 'jobs_attempt' AND column_name = 'released'"
        )
        assert cursor.fetchone()[0] == "false"  # raw INSERTs of attempts need not name it
