"""storage.throttle: the fixed window's upsert on the database's clock, exact when two
requests hit one key, and the pruning of ended windows."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction

from jobs.clock import db_now
from jobs.models import ThrottleWindow
from storage.throttle import KEY_MAX_CHARS, throttle_hit, throttle_windows_delete_ended
from tests.threads import in_thread, wait_for_lock_waiters

DAY = 86_400
HOUR = dt.timedelta(hours=1)


def _ends(key: str) -> dt.datetime:
    return ThrottleWindow.objects.get(throttle_key=key).window_ends_at


def _move(key: str, by: dt.timedelta) -> None:
    ThrottleWindow.objects.filter(throttle_key=key).update(window_ends_at=_ends(key) + by)


@pytest.mark.django_db
def test_hits_count_in_the_databases_current_window():
    before = db_now()
    hits = [throttle_hit(key="user:1", window_seconds=3600) for _ in range(3)]
    after = db_now()
    assert [hit.hits for hit in hits] == [1, 2, 3]
    assert throttle_hit(key="user:2", window_seconds=3600).hits == 1  # its own count
    ends = _ends("user:1")
    assert ends.timestamp() % 3600 == 0  # windows start at multiples of their length
    assert before < ends <= after + HOUR
    for hit in hits:  # until the window's end on the database's clock
        assert 0 < hit.retry_after <= 3600
        assert abs(hit.retry_after - (ends - before).total_seconds()) <= 5


@pytest.mark.django_db
def test_an_ended_window_starts_over_and_one_a_window_ahead_counts_on():
    current = [throttle_hit(key="k", window_seconds=3600) for _ in range(2)][-1]
    ends = _ends("k")
    _move("k", -HOUR)  # the row of the window before
    assert throttle_hit(key="k", window_seconds=3600).hits == 1
    assert _ends("k") == ends
    # A concurrent hit that read the clock later, at the edge, moved the row a window on:
    # this one counts in it, the window does not go back.
    _move("k", HOUR)
    ahead = throttle_hit(key="k", window_seconds=3600)
    assert ahead.hits == 2 and _ends("k") == ends + HOUR
    assert ahead.retry_after == pytest.approx(current.retry_after + 3600, abs=5)
    # More than a window ahead (the rate's length went from a day to an hour, or the
    # database's clock was set back): the current window, from 1.
    _move("k", HOUR)
    assert throttle_hit(key="k", window_seconds=3600).hits == 1
    assert _ends("k") == ends


@pytest.mark.django_db
def test_a_key_longer_than_the_column_is_cut_to_it():
    stem = "k" * KEY_MAX_CHARS
    assert throttle_hit(key=stem + "a", window_seconds=DAY).hits == 1
    assert throttle_hit(key=stem + "b", window_seconds=DAY).hits == 2  # the same 200 chars
    assert ThrottleWindow.objects.get().throttle_key == stem


@pytest.mark.django_db(transaction=True)
def test_a_concurrent_hit_waits_for_the_holder_and_counts_after_it():
    """Two connections on one key: the second upsert waits on the row the first holds,
    then counts on top of it; no hit is lost."""
    seen = []
    with transaction.atomic():
        assert throttle_hit(key="race", window_seconds=DAY).hits == 1
        other = in_thread(lambda: seen.append(throttle_hit(key="race", window_seconds=DAY)))
        wait_for_lock_waiters(1)
        assert seen == []  # still waiting while the holder's transaction is open
    other.join(timeout=20)
    assert [hit.hits for hit in seen] == [2]
    assert ThrottleWindow.objects.get(throttle_key="race").hits == 2


@pytest.mark.django_db(transaction=True)
def test_ended_windows_are_deleted_earliest_first_in_bounded_batches_locked_ones_skipped():
    for index in range(5):
        throttle_hit(key=f"ended:{index}", window_seconds=3600)
        _move(f"ended:{index}", -(index + 1) * HOUR)
    throttle_hit(key="current", window_seconds=3600)
    now = db_now()
    with transaction.atomic():
        assert throttle_hit(key="ended:4", window_seconds=3600).hits == 1  # held, current now
        _move("ended:4", -HOUR)  # ... and ended again, under this transaction's lock
        deleted = []
        in_thread(lambda: deleted.append(throttle_windows_delete_ended(now=now, limit=2))).join(
            timeout=20
        )
        assert deleted == [2]  # not waiting on the row this transaction holds
    left = set(ThrottleWindow.objects.values_list("throttle_key", flat=True))
    assert left == {"ended:0", "ended:1", "ended:4", "current"}  # earliest ended first
    assert throttle_windows_delete_ended(now=now, limit=10) == 3
    assert list(ThrottleWindow.objects.values_list("throttle_key", flat=True)) == ["current"]
