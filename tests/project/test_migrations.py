"""The migrations read as the schema: they match the models, and none imports another."""

import ast
from pathlib import Path

import pytest
from django.core.management import call_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.django_db
def test_the_models_need_no_new_migration():
    # Raises SystemExit(1) when a model changed without its migration.
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_no_migration_imports_another_or_holds_a_trigger():
    """Triggers and SQL functions are defined in storage/ and installed from there."""
    for path in ROOT.glob("*/migrations/0*.py"):
        tree = ast.parse(path.read_text())
        imported = [
            node.module or ""
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        ] + [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]  # fmt: skip
        assert not [name for name in imported if ".migrations" in name], path
        assert "importlib" not in imported, path
        assert "CREATE TRIGGER" not in path.read_text().upper(), path
