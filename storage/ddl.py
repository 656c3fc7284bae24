"""Triggers and SQL functions as values: defined in their concern's module, installed by
migrations."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Ddl:
    """A piece of schema that Django's models cannot express: its CREATE and its DROP."""

    create: str
    drop: str

    def operation(self):
        """The migration operation that installs it (and removes it on the way back)."""
        from django.db import migrations

        return migrations.RunSQL(self.create, reverse_sql=self.drop)
