"""A relay frozen (SIGSTOP) inside its publishing step, owner limits on: it holds no lock
another relay needs, so a second relay keeps publishing every owner's runs, and publishes
the frozen relay's claimed rows once their claim lease runs out."""

import signal
import time

import pytest
from django.db.models import Sum

from jobs.clock import db_now
from jobs.models import ActiveRun, OutboxMessage, Run, RunState
from tests.factories import owner, queued_run
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.drill]

LEASE = 20  # seconds: the relays' --claim-lease
LIMIT = 5  # SCHEDULER_OWNER_MAX_ACTIVE_RUNS
FROZEN_FOR = 60  # seconds


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _runs(owners, count: int) -> list[Run]:
    return [queued_run(user, run_at=db_now()) for user in owners for _ in range(count)]


def _pending(ids) -> int:
    return OutboxMessage.objects.filter(id__in=ids).count()


def test_a_relay_frozen_while_publishing_holds_back_no_owner(stack, report_figure):
    owners = [owner(f"frozen-relay-{index}") for index in range(3)]
    first = _runs(owners, 2)
    limits = {"SCHEDULER_OWNER_MAX_ACTIVE_RUNS": str(LIMIT)}
    frozen = stack.relay("relay-frozen", "--claim-lease", str(LEASE),
                         SCHEDULER_FAILPOINTS="relay.publishing=stop", **limits)  # fmt: skip
    wait_for(lambda: _state(frozen.pid) == "T", timeout=60, message="the relay to freeze")
    frozen_at = time.monotonic()
    claimed = list(
        OutboxMessage.objects.filter(claimed_by__isnull=False).values_list("id", flat=True)
    )
    assert len(claimed) == len(first)  # every owner's first runs, claimed by the frozen one

    stack.relay("relay", "--claim-lease", str(LEASE), **limits)
    second = _runs(owners, 2)
    rows = OutboxMessage.objects.filter(run__in=second).values_list("id", flat=True)
    rows = list(rows)
    wait_for(lambda: _pending(rows) == 0, timeout=LEASE, interval=0.2,
             message="every owner's new runs published beside the frozen relay")  # fmt: skip
    others_published = time.monotonic() - frozen_at
    assert _pending(claimed) == len(claimed)  # its claim still lasts: no one took them

    bound = LEASE + 15
    wait_for(lambda: _pending(claimed) == 0, timeout=bound, interval=0.2,
             message="the frozen relay's rows published by the other")  # fmt: skip
    taken_over = time.monotonic() - frozen_at
    assert _state(frozen.pid) == "T"
    for user in owners:  # 4 each, within the limit: 2 published, 2 taken over
        assert ActiveRun.objects.filter(owner=user).count() == 4 <= LIMIT

    time.sleep(max(0.0, FROZEN_FOR - (time.monotonic() - frozen_at)))
    frozen.send_signal(signal.SIGCONT)
    # Awake, it publishes its batch again (duplicates) and deletes and counts nothing.
    wait_for(lambda: _state(frozen.pid) != "T", timeout=10,
             message="the frozen relay to wake")  # fmt: skip
    stack.worker()
    wait_for(lambda: Run.objects.filter(state=RunState.SUCCEEDED).count() == 12, timeout=120,
             message="every run to succeed once")  # fmt: skip
    wait_for(
        lambda: Run.objects.aggregate(dup=Sum("duplicate_deliveries"))["dup"] == len(first),
        timeout=60,
        message="the frozen relay's duplicates refused",
    )
    assert frozen.poll() is None, stack.log("relay-frozen").decode()[-3000:]
    assert sorted(e["run_id"] for e in stack.executions()) == sorted(
        str(run.id) for run in first + second
    )
    report_figure(
        f"a relay frozen {FROZEN_FOR}s in its publishing step, owner limit {LIMIT}: the other "
        f"relay published every owner's new runs {others_published:.1f}s after the freeze and "
        f"the frozen relay's {len(claimed)} claimed rows {taken_over:.1f}s after it "
        f"(claim lease {LEASE}s)"
    )
