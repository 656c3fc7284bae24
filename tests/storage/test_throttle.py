"""storage.throttle: the fixed window's upsert, exact when two requests hit one key."""

from __future__ import annotations

import pytest
from django.db import transaction

from jobs.models import ThrottleWindow
from storage.throttle import KEY_MAX_CHARS, throttle_hit
from tests.threads import in_thread, wait_for_lock_waiters


@pytest.mark.django_db
def test_hits_count_within_a_window_and_a_new_window_starts_over():
    assert [throttle_hit(key="user:1", window=7) for _ in range(3)] == [1, 2, 3]
    assert throttle_hit(key="user:2", window=7) == 1  # another key, its own count
    assert throttle_hit(key="user:1", window=8) == 1
    assert throttle_hit(key="user:1", window=8) == 2
    assert ThrottleWindow.objects.get(throttle_key="user:1").bucket == 8


@pytest.mark.django_db
def test_a_key_longer_than_the_column_is_cut_to_it():
    stem = "k" * KEY_MAX_CHARS
    assert throttle_hit(key=stem + "a", window=1) == 1
    assert throttle_hit(key=stem + "b", window=1) == 2  # the same first 200 characters
    assert ThrottleWindow.objects.get().throttle_key == stem


@pytest.mark.django_db(transaction=True)
def test_a_concurrent_hit_waits_for_the_holder_and_counts_after_it():
    """Two connections on one key: the second upsert waits on the row the first holds,
    then counts on top of it; no hit is lost."""
    seen = []
    with transaction.atomic():
        assert throttle_hit(key="race", window=1) == 1
        other = in_thread(lambda: seen.append(throttle_hit(key="race", window=1)))
        wait_for_lock_waiters(1)
        assert seen == []  # still waiting while the holder's transaction is open
    other.join(timeout=20)
    assert seen == [2]
    assert ThrottleWindow.objects.get(throttle_key="race").hits == 2
