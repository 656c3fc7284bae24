# Indexes for retention and for costs that grow with due work only: run_finished_idx,
# through which the pruner finds the oldest finished runs (jobs.retention); a job's active
# runs and its latest finished ones (overlap, pause_after_failures, completion); the jobs
# awaiting completion. Built CONCURRENTLY on PostgreSQL (jobs_run of a deployment that never
# pruned is large, and a plain build would stop every write to it), so this migration is
# not atomic and holds nothing else. A build that failed or was cancelled leaves an INVALID
# index: `DROP INDEX CONCURRENTLY IF EXISTS <name>;` then `migrate` again.

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class AddIndexOnline(AddIndexConcurrently):
    """CREATE INDEX CONCURRENTLY on PostgreSQL: jobs_run of a deployment that never pruned
    is large, and a plain build would stop every write to it until done. A plain index
    elsewhere (SQLite)."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        return migrations.AddIndex.database_forwards(
            self, app_label, schema_editor, from_state, to_state
        )

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        return migrations.AddIndex.database_backwards(
            self, app_label, schema_editor, from_state, to_state
        )


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ("jobs", "0017_retention_and_skew"),
    ]

    operations = [
        AddIndexOnline(
            model_name="run",
            index=models.Index(
                condition=models.Q(("state__in", ["cancelled", "failed", "skipped", "succeeded"])),
                fields=["finished_at"],
                name="run_finished_idx",
            ),
        ),
        AddIndexOnline(
            model_name="job",
            index=models.Index(
                condition=models.Q(
                    ("deleted_at", None), ("next_run_at", None), ("state", "active")
                ),
                fields=["id"],
                name="job_awaiting_completion_idx",
            ),
        ),
        AddIndexOnline(
            model_name="run",
            index=models.Index(
                condition=models.Q(("state__in", ["pending", "queued", "retry_wait", "running"])),
                fields=["job", "created_at"],
                name="run_job_active_idx",
            ),
        ),
        AddIndexOnline(
            model_name="run",
            index=models.Index(
                condition=models.Q(("state__in", ["failed", "succeeded"])),
                fields=["job", "finished_at", "id"],
                name="run_job_finished_idx",
            ),
        ),
    ]
