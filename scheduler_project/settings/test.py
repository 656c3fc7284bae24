"""Test settings: the real PostgreSQL and RabbitMQ unless the environment says otherwise."""

import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
# One RabbitMQ vhost per test session (created by tests/conftest.py), unless a broker URL
# is given explicitly.
TEST_RABBITMQ_VHOST = None
if "CELERY_BROKER_URL" not in os.environ:
    TEST_RABBITMQ_VHOST = f"scheduler_test_{os.getpid()}"
    os.environ["CELERY_BROKER_URL"] = f"amqp://guest:guest@127.0.0.1:5672/{TEST_RABBITMQ_VHOST}"
os.environ.setdefault("SCHEDULER_TASK_MODULES", "tests.sample_tasks,tests.fault_tasks")

from .base import *  # noqa: E402,F403
from .base import DATABASES  # noqa: E402

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
    "location": str(VAR_DIR / f"test-logs-{os.getpid()}")  # noqa: F405
}
