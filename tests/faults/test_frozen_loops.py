"""A scheduler process frozen inside one of its maintenance loops' transactions: the rows
that transaction locked are released within a bounded time, not when PostgreSQL's
idle-in-transaction timeout (600 s) ends the session."""

import datetime as dt
import time

import pytest
from django.db import OperationalError, connection, transaction

from dispatch.management.commands.scheduler import LOOP_IDLE_IN_TRANSACTION_SECONDS
from dispatch.reaper import ReaperConfig, reaper_run_once
from jobs.clock import db_now
from jobs.models import Attempt, AttemptState
from tests.factories import claim, owner, queued_run
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _row_locked(attempt_id: int) -> bool:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM jobs_attempt WHERE id = %s FOR NO KEY UPDATE NOWAIT", [attempt_id]
            )
        return False
    except OperationalError:
        return True


def test_a_reaper_frozen_while_ending_an_attempt_lets_its_rows_go(stack, report_figure):
    """The reaper freezes (SIGSTOP, by a failpoint) with an expired attempt ended in its
    open transaction, holding the attempt's and the run's rows: its session is ended after
    LOOP_IDLE_IN_TRANSACTION_SECONDS idle, the rows are free again, and another reaper
    ends the attempt."""
    now = db_now()
    run = queued_run(owner(), run_at=now - dt.timedelta(seconds=120),
                     created=now - dt.timedelta(seconds=180))  # fmt: skip
    attempt = claim(run, at=now - dt.timedelta(seconds=60))  # its 30 s lease long expired
    stack.scheduler("scheduler", "--without-reconciler", "--without-pruner",
                    SCHEDULER_FAILPOINTS="reaper.after_end=stop")  # fmt: skip
    pid = stack.processes["scheduler"].pid
    wait_for(lambda: _state(pid) == "T", timeout=30, interval=0.05,
             message="the reaper to freeze")  # fmt: skip
    frozen_at = time.monotonic()
    # The frozen transaction holds the row: seen here unless this test itself was held up
    # past the bound (a loaded machine) and the session already ended, which the checks
    # below (the row free, the ending rolled back, the process still frozen) cover alike.
    try:
        wait_for(lambda: _row_locked(attempt.id), timeout=2, interval=0.05,
                 message="the frozen reaper's row lock")  # fmt: skip
        seen_locked = True
    except AssertionError:
        seen_locked = False

    bound = LOOP_IDLE_IN_TRANSACTION_SECONDS + 5
    wait_for(lambda: not _row_locked(attempt.id), timeout=bound, interval=0.2,
             message="the frozen reaper's row lock to go")  # fmt: skip
    released = time.monotonic() - frozen_at
    assert _state(pid) == "T"  # still frozen: its session was ended, not its process
    # Its ending rolled back with the session; another reaper ends the attempt.
    assert Attempt.objects.get(id=attempt.id).state == AttemptState.RUNNING
    assert reaper_run_once(now=db_now(), config=ReaperConfig()).lost == 1
    assert Attempt.objects.get(id=attempt.id).state == AttemptState.LOST
    stack.kill("scheduler")
    report_figure(
        f"a reaper frozen inside its transaction: the attempt's row free {released:.1f}s "
        f"after the freeze (idle-in-transaction bound {LOOP_IDLE_IN_TRANSACTION_SECONDS}s; "
        f"the lock {'seen' if seen_locked else 'already gone'} at the freeze)"
    )
