"""storage.clock: the database server's clock."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction

from storage.clock import clock_now


@pytest.mark.django_db
def test_the_clock_is_the_servers_in_utc_and_moves_inside_a_transaction():
    with transaction.atomic():
        first = clock_now()
        second = clock_now()
    assert first.tzinfo == dt.UTC
    # clock_timestamp(), not the transaction's start: two calls in one transaction differ.
    assert second > first
    assert abs(first - dt.datetime.now(dt.UTC)) < dt.timedelta(minutes=5)
