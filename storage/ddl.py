"""Triggers and SQL functions as values: defined in their concern's module, installed by
migrations."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Ddl:
    """A piece of schema that Django's models cannot express: its CREATE and its DROP, each
    a script of one or more statements (PL/pgSQL bodies in dollar quotes)."""

    create: str
    drop: str

    def operation(self):
        """The migration operation that installs it (and removes it on the way back): each
        script sent whole, as one execute, in the migration's transaction."""
        from django.db import migrations

        return migrations.RunSQL([self.create], reverse_sql=[self.drop])
