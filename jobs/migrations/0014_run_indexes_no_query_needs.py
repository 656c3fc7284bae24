"""Indexes no query needs, which every version of a run (created, reserved, finished) and
every attempt wrote: the foreign-key indexes of Run.job (run_job_idx, on job_id and
scheduled_for, serves every lookup by job) and Attempt.run (attempt_number_unique, on
run_id and number, serves every lookup by run), and the `LIKE` index PostgreSQL's backend
adds beside a unique varchar (nothing matches idempotency keys by pattern; the unique
constraint stays)."""

import django.db.models.deletion
from django.db import migrations, models


# name -> its definition. Dropped by name: Django's AlterField of a foreign key's db_index
# drops every single-column index on the column, the partial unique attempt_one_running too.
INDEXES = {
    "jobs_run_idempotency_key_7ea90ab1_like":
        "ON jobs_run (idempotency_key varchar_pattern_ops)",
    "jobs_run_job_id_f26ec71d": "ON jobs_run (job_id)",
    "jobs_attempt_run_id_c006c626": "ON jobs_attempt (run_id)",
}


def _drop_indexes(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in INDEXES:
            schema_editor.execute(f"DROP INDEX IF EXISTS {name}")


def _create_indexes(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name, definition in INDEXES.items():
            schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {name} {definition}")


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0013_released_attempts_not_counted'),
    ]

    operations = [
        migrations.RunPython(_drop_indexes, _create_indexes),
        # The state only; on SQLite (no reservation, small tables) the indexes stay.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='attempt',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='attempts', to='jobs.run'),
                ),
                migrations.AlterField(
                    model_name='run',
                    name='job',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='runs', to='jobs.job'),
                ),
            ],
        ),
    ]
