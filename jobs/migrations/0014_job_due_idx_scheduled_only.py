# job_due_idx holds only the active jobs that have a next fire. It held every active job,
# those whose schedule is over (next_run_at NULL) too, and the completion's job lock
# (storage.completion, `id = $1 AND next_run_at IS NULL`, a generic plan) could walk it
# through every job awaiting completion instead of reading the primary key: a burst of N
# one-time jobs then cost N² index reads to complete (docs/log.md, 2026-12-06). Every
# query of due jobs asks `next_run_at <= now` or for the least next_run_at, which imply
# NOT NULL. The new index is built concurrently, then takes the old one's name: writes go
# on throughout.

from django.db import migrations, models


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
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX CONCURRENTLY IF EXISTS job_due_scheduled_idx",
                    reverse_sql=migrations.RunSQL.noop,
                ),
                migrations.RunSQL(
                    "CREATE INDEX CONCURRENTLY job_due_scheduled_idx ON jobs_job (next_run_at)"
                    " WHERE next_run_at IS NOT NULL AND state = 'active'",
                    reverse_sql="DROP INDEX CONCURRENTLY job_due_scheduled_idx",
                ),
                migrations.RunSQL(
                    "DROP INDEX CONCURRENTLY job_due_idx",
                    reverse_sql="CREATE INDEX CONCURRENTLY job_due_idx ON jobs_job (next_run_at)"
                    " WHERE state = 'active'",
                ),
                migrations.RunSQL(
                    "ALTER INDEX job_due_scheduled_idx RENAME TO job_due_idx",
                    reverse_sql="ALTER INDEX job_due_idx RENAME TO job_due_scheduled_idx",
                ),
            ],
        ),
    ]
