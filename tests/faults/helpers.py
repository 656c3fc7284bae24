"""Shared steps of the fault-injection tests (their jobs come from tests.factories)."""

from __future__ import annotations

import os

import pytest

from jobs.models import Counter

# Tests that restart or reconfigure the machine's PostgreSQL or RabbitMQ (not a test
# database or vhost of their own) run only where that is allowed: CI sets it (.ci/run); on
# a developer's machine they would restart the developer's own services.
RESTART_SERVICES = "SCHEDULER_TEST_RESTART_SERVICES"
restarts_services = pytest.mark.skipif(
    os.environ.get(RESTART_SERVICES) != "1",
    reason=f"restarts or reconfigures the machine's PostgreSQL/RabbitMQ: set {RESTART_SERVICES}=1",
)


def counter(name: str, labels: str = "") -> int:
    return (
        Counter.objects.filter(name=name, labels=labels).values_list("value", flat=True).first()
        or 0
    )
