"""Test settings: the real PostgreSQL and RabbitMQ unless the environment says otherwise.

Where no PostgreSQL answers at DATABASE_URL (by default 127.0.0.1:5432), the tests run on
an embedded PostgreSQL of their own (a server per test session in var/, stopped and removed
by tests/conftest.py), and the tests that need RabbitMQ are skipped when it does not
answer; under CI=true neither stands in: a missing service fails the run."""

import os
import socket
from urllib.parse import urlsplit

from .database_url import database_hosts_split

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/test"
DEFAULT_BROKER_HOST = "127.0.0.1"
CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def answers(url: str, default_port: int) -> bool:
    """Whether something accepts connections at any place `url` points to (TCP, or a Unix
    socket's folder as PostgreSQL names it): libpq's several hosts (`h1:p1,h2:p2`) and
    kombu's several URLs (`amqp://a;amqp://b`) alike."""
    return any(
        _accepts(host, port)
        for one in url.split(";")
        for host, port in url_hosts(one, default_port)
    )


def url_hosts(url: str, default_port: int) -> list[tuple[str, int]]:
    hosts = urlsplit(url).netloc.rsplit("@", 1)[-1]
    return [(host or "127.0.0.1", port or default_port)
            for host, port in database_hosts_split(hosts)]  # fmt: skip


def _accepts(host: str, port: int) -> bool:
    family, address = (
        (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}")
        if host.startswith("/")
        else (socket.AF_INET, (host, port))
    )
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(address)
        except OSError:
            return False
    return True


os.environ.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
TEST_EMBEDDED_POSTGRES = not CI and not answers(os.environ["DATABASE_URL"], 5432)
# One RabbitMQ vhost per test session (created by tests/conftest.py), unless a broker URL
# is given explicitly.
TEST_RABBITMQ_VHOST = None
if "CELERY_BROKER_URL" not in os.environ:
    TEST_RABBITMQ_VHOST = f"scheduler_test_{os.getpid()}"
    os.environ["CELERY_BROKER_URL"] = (
        f"amqp://guest:guest@{DEFAULT_BROKER_HOST}:5672/{TEST_RABBITMQ_VHOST}"
    )
TEST_RABBITMQ_MISSING = not CI and not answers(os.environ["CELERY_BROKER_URL"], 5672)
os.environ.setdefault("SCHEDULER_TASK_MODULES", "tests.sample_tasks,tests.fault_tasks")

from .base import *  # noqa: E402,F403
from .base import DATABASES, VAR_DIR, embedded_database  # noqa: E402

if TEST_EMBEDDED_POSTGRES:
    DATABASES["default"] = embedded_database(VAR_DIR / f"test-postgres-{os.getpid()}")
# One database per test session, so that concurrent runs never meet.
DATABASES["default"]["TEST"] = {"NAME": f"test_scheduler_{os.getpid()}"}
DATABASES["default"]["CONN_MAX_AGE"] = 0
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Throttles out of the way, unless a test sets its own rates.
REST_FRAMEWORK = {  # noqa: F405
    **REST_FRAMEWORK,  # noqa: F405
    "DEFAULT_THROTTLE_RATES": {
        scope: "100000/min"
        for scope in REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]  # noqa: F405
    },
}

# Run logs' content goes to a directory of this test session, removed with the var/ tree.
STORAGES["scheduler_logs"]["OPTIONS"] = {  # noqa: F405
    "location": str(VAR_DIR / f"test-logs-{os.getpid()}")
}

# The live tails' slots of this test session, shared with the web processes it starts
# (they inherit the variable), apart from any other session's.
SCHEDULER_LOG_FOLLOW_SLOTS_DIR = os.environ.setdefault(
    "SCHEDULER_LOG_FOLLOW_SLOTS_DIR", str(VAR_DIR / f"log-follow-{os.getpid()}")
)
