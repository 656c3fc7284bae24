# job_due_idx holds only the active jobs that have a next fire. It held every active job,
# those whose schedule is over (next_run_at NULL, awaiting completion) too, and the
# completion's job lock (storage.completion: `id = $1 AND next_run_at IS NULL`, a generic
# plan kept for the connection's life) could be planned as a walk of it through every job
# awaiting completion instead of a primary key probe: a burst of N one-time jobs then cost
# N² index reads to complete. Every query of due jobs asks `next_run_at <= now` or for the
# least next_run_at, which imply NOT NULL.
#
# The new index is built under another name, then takes the old one's: CONCURRENTLY (writes
# go on) unless the migration runs inside a transaction (a test migrating back and forth),
# where PostgreSQL refuses it. Each step may be run again after an interruption.

from django.db import migrations, models

FORWARD = [
    "DROP INDEX{how} IF EXISTS job_due_scheduled_idx",
    "CREATE INDEX{how} job_due_scheduled_idx ON jobs_job (next_run_at)"
    " WHERE next_run_at IS NOT NULL AND state = 'active'",
    "DROP INDEX{how} IF EXISTS job_due_idx",
    "ALTER INDEX job_due_scheduled_idx RENAME TO job_due_idx",
]
BACKWARD = [
    "DROP INDEX{how} IF EXISTS job_due_former_idx",
    "CREATE INDEX{how} job_due_former_idx ON jobs_job (next_run_at) WHERE state = 'active'",
    "DROP INDEX{how} IF EXISTS job_due_idx",
    "ALTER INDEX job_due_former_idx RENAME TO job_due_idx",
]


def _steps(statements):
    def run(apps, schema_editor):
        how = "" if schema_editor.connection.in_atomic_block else " CONCURRENTLY"
        for statement in statements:
            schema_editor.execute(statement.format(how=how))

    return run


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("jobs", "0013_run_index_review"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="job", name="job_due_idx"),
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(
                        condition=models.Q(("next_run_at__isnull", False), ("state", "active")),
                        fields=["next_run_at"],
                        name="job_due_idx",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(_steps(FORWARD), _steps(BACKWARD))],
        ),
    ]
