"""The worker process's lease keeper against PostgreSQL: one attempt's row held by another
session (a reaper frozen while ending it) neither holds back the renewal of the others nor
makes a heartbeat say a lease was renewed when it was not."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import transaction

from dispatch.worker.keeper import LeaseKeeper
from jobs.clock import db_now
from jobs.models import Attempt, AttemptState
from tests.factories import claim
from tests.threads import in_thread

LEASE_SECONDS = 6.0  # a heartbeat waits max(a third of it, 5 s) for its renewal


@pytest.fixture
def keeper():
    keeper = LeaseKeeper()
    yield keeper
    for lease in keeper.held():
        keeper.release(lease)  # the keeper lets its connection go once it holds nothing
    time.sleep(0.2)


def frozen_reaper(attempt: Attempt, locked: threading.Event, release: threading.Event,
                  *, commit: bool) -> None:  # fmt: skip
    """What a reaper ending `attempt` holds, until `release`: its row, updated to `lost`."""
    with transaction.atomic():
        Attempt.objects.filter(id=attempt.id, state=AttemptState.RUNNING).update(
            state=AttemptState.LOST
        )
        locked.set()
        release.wait(20)
        transaction.set_rollback(not commit)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("commit", [False, True], ids=["rolled-back", "committed"])
def test_a_row_held_elsewhere_holds_back_only_its_own_lease(queued_run, keeper, commit):
    now = db_now()
    held, free = claim(queued_run(), at=now), claim(queued_run(), at=now)
    held_lease = keeper.hold(held, LEASE_SECONDS)
    free_lease = keeper.hold(free, LEASE_SECONDS)
    locked, release = threading.Event(), threading.Event()
    reaper = in_thread(lambda: frozen_reaper(held, locked, release, commit=commit))
    assert locked.wait(10)
    try:
        held_lease.renew_at = 0.0  # both due: renewed in one statement
        started = time.monotonic()
        assert keeper.renew_now(free_lease) is True
        waited = time.monotonic() - started
        assert waited < 2.0, f"the heartbeat waited {waited:.1f}s for another attempt's row"
        renewed = Attempt.objects.get(id=free.id).lease_expires_at
        assert renewed > now + dt.timedelta(seconds=LEASE_SECONDS)
        # Its own row held: not renewed, and the heartbeat says so, without losing the
        # lease on a lock that may yet be rolled back.
        assert keeper.renew_now(held_lease) is False
        assert not held_lease.lost.is_set()
    finally:
        release.set()
        reaper.join(10)
    if commit:  # the reaper ended it: lost, and the handler is told
        assert keeper.renew_now(held_lease) is False
        assert held_lease.lost.is_set()
    else:  # the reaper gave up (its lock timeout): the lease goes on
        assert keeper.renew_now(held_lease) is True
        assert not held_lease.lost.is_set()
