"""Which outbox rows share a broker message."""

import dataclasses

import pytest

from dispatch.packing import (
    AUTO_MIN_RUNS,
    AUTO_PACK_MAX,
    PROBE_AGAIN_SECONDS,
    PROBE_RUNS,
    PROBE_WAIT_SECONDS,
    PackSizes,
    outbox_packs,
    pack_size_decide,
    pack_time_limit,
)
from jobs.registry import task_pack_declared, task_pack_size, task_register
from storage.durations import TaskDurations


@dataclasses.dataclass
class Row:
    id: int
    task_name: str
    queue: str = "jobs"
    priority: int = 0
    timeout_seconds: int | None = 3600


SIZES = {"short": 3, "long": 1}


def packs(rows):
    return [
        [row.id for row in pack]
        for pack in outbox_packs(rows, pack_size=lambda name: SIZES.get(name, 1))
    ]


def test_rows_of_a_short_task_fill_packs_in_order_and_a_long_task_goes_alone():
    rows = [Row(1, "short"), Row(2, "long"), Row(3, "short"), Row(4, "short"),
            Row(5, "short"), Row(6, "long")]  # fmt: skip
    assert packs(rows) == [[1, 3, 4], [2], [5], [6]]


def test_only_rows_that_would_make_the_same_message_share_one():
    rows = [Row(1, "short"), Row(2, "short", queue="other"), Row(3, "short", priority=5),
            Row(4, "short", timeout_seconds=60), Row(5, "short")]  # fmt: skip
    assert packs(rows) == [[1, 5], [2], [3], [4]]


def test_an_unknown_task_is_never_packed():
    assert packs([Row(1, "unknown"), Row(2, "unknown")]) == [[1], [2]]


def test_a_packs_hard_limit_has_room_for_each_run():
    assert pack_time_limit(60, 5, 15) == 375
    assert pack_time_limit(None, 5, 15) is None


# -- how many runs a message carries when the task declares nothing -------------------


def test_a_declared_size_wins_whatever_the_runs_took():
    assert pack_size_decide(1, TaskDurations(100, 0.001, 0.001)) == 1
    assert pack_size_decide(7, TaskDurations(100, 5.0, 5.0)) == 7
    assert pack_size_decide(20, None) == 20


def test_a_task_with_too_few_finished_runs_is_not_decided():
    assert pack_size_decide(None, None) is None
    assert pack_size_decide(None, TaskDurations(AUTO_MIN_RUNS - 1, 0.001, 0.001)) is None


def test_a_short_task_is_packed_so_a_pack_stays_under_a_second():
    assert pack_size_decide(None, TaskDurations(AUTO_MIN_RUNS, 0.001, 0.002)) == AUTO_PACK_MAX
    assert pack_size_decide(None, TaskDurations(50, 0.08, 0.2)) == 12
    # A rare slow run pulls the mean above the threshold: alone.
    assert pack_size_decide(None, TaskDurations(50, 0.3, 0.002)) == 1


def test_a_long_task_travels_alone():
    assert pack_size_decide(None, TaskDurations(50, 5.0, 5.0)) == 1
    assert pack_size_decide(None, TaskDurations(50, 0.05, 0.25)) == 1


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def sizes(figures, clock, declared=None):
    return PackSizes(read=lambda: dict(figures), declared=lambda name: (declared or {}).get(name),
                     clock=clock, sleep=clock.sleep)  # fmt: skip


def test_a_task_with_no_history_is_probed_then_packed_once_its_figures_show_it_short():
    clock, figures = Clock(), {}
    packing = sizes(figures, clock)
    rows = [Row(i, "new") for i in range(30)] + [Row(100, "other")]
    first, rest = packing.probe(rows)
    assert [row.id for row in first] == list(range(PROBE_RUNS))
    assert len(rest) == 31 - PROBE_RUNS and packing("new") == 1
    figures["new"] = TaskDurations(AUTO_MIN_RUNS, 0.002, 0.003)  # the probe's runs finished
    packing.await_figures({"new"})
    assert 0 < clock.now < PROBE_WAIT_SECONDS
    assert packing("new") == AUTO_PACK_MAX
    assert packing.probe(rows) == ([], rows)


def test_a_probe_without_figures_gives_up_and_is_not_repeated_at_once():
    clock = Clock()
    packing = sizes({}, clock)
    rows = [Row(i, "slow") for i in range(PROBE_RUNS + 1)]
    first, _ = packing.probe(rows)
    assert len(first) == PROBE_RUNS
    packing.await_figures({"slow"})
    assert PROBE_WAIT_SECONDS <= clock.now < PROBE_WAIT_SECONDS + 0.1
    assert packing("slow") == 1
    assert packing.probe(rows) == ([], rows)
    clock.now += PROBE_AGAIN_SECONDS
    assert len(packing.probe(rows)[0]) == PROBE_RUNS


def test_few_rows_declared_tasks_and_known_tasks_are_not_probed():
    clock = Clock()
    packing = sizes({"known": TaskDurations(50, 5.0, 5.0)}, clock, declared={"fixed": 20})
    rows = ([Row(i, "few") for i in range(PROBE_RUNS)] + [Row(50 + i, "fixed") for i in range(30)]
            + [Row(90 + i, "known") for i in range(30)])  # fmt: skip
    assert packing.probe(rows) == ([], rows)
    assert packing("fixed") == 20 and packing("known") == 1 and packing("few") == 1


def test_the_registry_tells_a_task_that_declared_nothing_from_one_that_declared_pack_1():
    def handler(ctx):
        return None

    task_register(name="tests.packing.nothing", handler=handler)
    task_register(name="tests.packing.alone", handler=handler, pack=1)
    assert task_pack_declared("tests.packing.nothing") is None
    assert task_pack_declared("tests.packing.alone") == 1
    assert task_pack_size("tests.packing.nothing") == 1
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="pack must be"):
            task_register(name="tests.packing.bad", handler=handler, pack=bad)
