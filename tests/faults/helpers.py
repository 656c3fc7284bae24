"""Shared steps of the fault-injection tests (their jobs come from tests.factories)."""

from __future__ import annotations

from jobs.models import Counter


def counter(name: str, labels: str = "") -> int:
    return (
        Counter.objects.filter(name=name, labels=labels).values_list("value", flat=True).first()
        or 0
    )
