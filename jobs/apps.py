from django.apps import AppConfig
from django.db.models.signals import post_migrate


class JobsConfig(AppConfig):
    name = "jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        post_migrate.connect(sqlite_tally_triggers_restore, sender=self)


def sqlite_tally_triggers_restore(*, using: str, **kwargs) -> None:
    """SQLite (embedded defaults) loses a table's triggers whenever a migration remakes the
    table (its ALTER TABLE cannot do most changes), as adding `Attempt.task_id` did: after
    every migrate, the metrics' triggers of jobs/migrations/0008_tally.py that are missing
    are created again. PostgreSQL alters tables in place and keeps them."""
    import importlib

    from django.db import connections

    connection = connections[using]
    if connection.vendor != "sqlite":
        return
    tally = importlib.import_module("jobs.migrations.0008_tally")
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        present = {name for (name,) in cursor.fetchall()}
        for name, statement in zip(tally.SQLITE_TRIGGERS, tally.SQLITE, strict=True):
            if name not in present:
                cursor.execute(statement)
