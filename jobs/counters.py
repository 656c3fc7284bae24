"""Durable counters, shared by every process and exported on /metrics."""

from django.db import IntegrityError, transaction
from django.db.models import F

from .models import Counter


def counter_increment(name: str, *, by: int = 1, labels: str = "") -> None:
    """Add `by` to a counter; call inside the transaction of the event it counts."""
    if Counter.objects.filter(name=name, labels=labels).update(value=F("value") + by):
        return
    try:
        with transaction.atomic():
            Counter.objects.create(name=name, labels=labels, value=by)
    except IntegrityError:  # another process created it first
        Counter.objects.filter(name=name, labels=labels).update(value=F("value") + by)
