"""What every benchmark needs: a fresh PostgreSQL database and RabbitMQ vhost of its own,
the environment its processes run with, and Django set up on it; all dropped afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PG = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
RABBIT = os.environ.get("BENCH_RABBIT", "amqp://guest:guest@127.0.0.1:5672")


@contextlib.contextmanager
def bench_environment(prefix: str, *, task_modules: str) -> Iterator[tuple[dict, Path]]:
    """(the processes' environment, a work directory); Django is set up on it, migrated."""
    name = f"{prefix}_{os.getpid()}"
    subprocess.run(["psql", f"{PG}/postgres", "-qc", f"CREATE DATABASE {name}"], check=True)
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", name], check=True)
    subprocess.run(
        ["rabbitmqctl", "-q", "set_permissions", "-p", name, "guest", ".*", ".*", ".*"], check=True
    )
    workdir = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    env = {
        **os.environ,
        "DATABASE_URL": f"{PG}/{name}",
        "CELERY_BROKER_URL": f"{RABBIT}/{name}",
        "DJANGO_SETTINGS_MODULE": "scheduler_project.settings.base",
        "SCHEDULER_TASK_MODULES": task_modules,
        "SCHEDULER_VAR_DIR": str(workdir),
    }
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    try:
        call_command("migrate", verbosity=0)
        yield env, workdir
    finally:
        connection.close()
        subprocess.run(
            ["psql", f"{PG}/postgres", "-qc", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"]
        )
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", name])
