"""Which outbox rows share a broker message."""

import dataclasses

from dispatch.packing import outbox_packs, pack_time_limit


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
