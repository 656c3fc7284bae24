"""Packing: the runs of a short task that a relay publishes together travel several to a
broker message (`job_task(name, pack=N)`), so a burst costs a fraction of the messages,
task dispatches and broker round trips. The worker runs a pack's runs one after another,
each claimed when its turn comes, and records their successes together
(dispatch.worker.run_execute_deliveries).

Only rows that would have made identical messages but for their run share one: the same
task, queue, priority and time limit. Order is kept within each pack (oldest first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class _Row(Protocol):
    task_name: str
    queue: str
    priority: int
    timeout_seconds: int | None


Row = TypeVar("Row", bound=_Row)


def outbox_packs(rows: Sequence[Row], *, pack_size: Callable[[str], int]) -> list[list[Row]]:
    """The rows grouped into messages: a task whose pack size is 1 gets one message per
    row; others fill packs of up to their size. Packs come in the order of their first row."""
    packs: list[list[Row]] = []
    filling: dict[tuple, list[Row]] = {}
    for row in rows:
        size = pack_size(row.task_name)
        if size <= 1:
            packs.append([row])
            continue
        key = (row.task_name, row.queue, row.priority, row.timeout_seconds)
        pack = filling.get(key)
        if pack is None or len(pack) >= size:
            pack = filling[key] = []
            packs.append(pack)
        pack.append(row)
    return packs


def pack_time_limit(timeout_seconds: int | None, runs: int, grace: int) -> int | None:
    """The Celery hard time limit of a packed message: room for every run's own limit and
    grace, the backstop for a handler that ignores its soft limit (each run's soft limit is
    the worker's, per run)."""
    return (timeout_seconds + grace) * runs if timeout_seconds else None
