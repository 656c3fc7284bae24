"""Packing: the runs of a short task that a relay publishes together travel several to a
broker message, so a burst costs a fraction of the messages, task dispatches and broker
round trips. The worker runs a pack's runs one after another, each claimed when its turn
comes, and records their successes together (dispatch.worker.run_execute_deliveries).

How many runs a message carries (`pack_size_decide`): what the task declared
(`job_task(name, pack=N)`; `pack=1` never packs), else what its recent runs took
(storage.durations, read by the relay every FIGURES_TTL seconds, `PackSizes`): once
AUTO_MIN_RUNS have finished, a task whose mean is under AUTO_SHORT_SECONDS and whose 90th
percentile is under AUTO_P90_SECONDS is packed, as many runs as fit AUTO_PACK_SECONDS at
that mean, at most AUTO_PACK_MAX; any other travels alone. (A run's recorded time
includes the wait for its success to be written, up to the worker's success batch, which
a no-op's 90th percentile shows on a loaded machine: hence the looser bound on it.)
A task with no history yet travels alone; when the relay has more of its runs at once
than PROBE_RUNS, it publishes PROBE_RUNS of them first and waits up to PROBE_WAIT_SECONDS
for their figures before publishing the rest, so the first burst of a short task is
packed and a long one never.

Only rows that would have made identical messages but for their run share one: the same
task, queue, priority and time limit. Order is kept within each pack (oldest first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from jobs.registry import task_pack_declared
from storage.durations import TaskDurations, task_durations_recent

AUTO_MIN_RUNS = 5  # finished runs before a task's figures count
AUTO_SHORT_SECONDS = 0.1  # a mean under this (and a p90 under AUTO_P90_SECONDS): packed
AUTO_P90_SECONDS = 0.25
AUTO_PACK_SECONDS = 1.0  # a pack's expected time, at the mean, stays under this
AUTO_PACK_MAX = 20
FIGURES_TTL = 5.0  # seconds the relay keeps the figures it read
PROBE_RUNS = 8  # runs of a task with no history published alone before the rest
PROBE_WAIT_SECONDS = 1.0  # the longest wait for a probe's figures
PROBE_POLL_SECONDS = 0.02
PROBE_AGAIN_SECONDS = 60.0  # a task probed without an answer travels alone this long


def pack_size_decide(declared: int | None, durations: TaskDurations | None) -> int | None:
    """Runs per message: the declared size; else from the task's recent runs (1 for a
    long one); None while it has too few finished runs to tell."""
    if declared is not None:
        return declared
    if durations is None or durations.count < AUTO_MIN_RUNS:
        return None
    if durations.mean >= AUTO_SHORT_SECONDS or durations.p90 >= AUTO_P90_SECONDS:
        return 1
    return max(1, min(AUTO_PACK_MAX, int(AUTO_PACK_SECONDS / max(durations.mean, 1e-6))))


class PackSizes:
    """The relay process's pack sizes: the declared ones, else decided from the figures of
    storage.durations, read at most every FIGURES_TTL seconds (and every PROBE_POLL_SECONDS
    while waiting for a probe's)."""

    def __init__(
        self,
        *,
        read: Callable[[], dict[str, TaskDurations]] = task_durations_recent,
        declared: Callable[[str], int | None] = task_pack_declared,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._read, self._declared, self._clock, self._sleep = read, declared, clock, sleep
        self._figures: dict[str, TaskDurations] = {}
        self._read_at = -float("inf")
        self._probed: dict[str, float] = {}  # task -> when its probe was published

    def _refresh(self, *, older_than: float) -> None:
        if self._clock() - self._read_at >= older_than:
            self._figures = self._read()
            self._read_at = self._clock()

    def decided(self, name: str) -> int | None:
        self._refresh(older_than=FIGURES_TTL)
        return pack_size_decide(self._declared(name), self._figures.get(name))

    def __call__(self, name: str) -> int:
        """Runs per message now: a task not decided yet travels alone."""
        return self.decided(name) or 1

    def probe(self, rows: Sequence[Row]) -> tuple[list[Row], list[Row]]:
        """The rows to publish first (PROBE_RUNS of each task with no history and more
        rows than that, not probed lately), and the rest."""
        now = self._clock()
        counts: dict[str, int] = {}
        for row in rows:
            counts[row.task_name] = counts.get(row.task_name, 0) + 1
        probing = {
            name for name, count in counts.items()
            if count > PROBE_RUNS and self.decided(name) is None
            and now - self._probed.get(name, -float("inf")) >= PROBE_AGAIN_SECONDS
        }  # fmt: skip
        if not probing:
            return [], list(rows)
        first: list[Row] = []
        rest: list[Row] = []
        taken = dict.fromkeys(probing, 0)
        for row in rows:
            if row.task_name in taken and taken[row.task_name] < PROBE_RUNS:
                taken[row.task_name] += 1
                first.append(row)
            else:
                rest.append(row)
        for name in probing:
            self._probed[name] = now
        return first, rest

    def await_figures(self, names: Iterable[str]) -> None:
        """Wait (at most PROBE_WAIT_SECONDS) until every task named has enough figures."""
        waiting = set(names)
        deadline = self._clock() + PROBE_WAIT_SECONDS
        while waiting and self._clock() < deadline:
            self._sleep(PROBE_POLL_SECONDS)
            self._refresh(older_than=PROBE_POLL_SECONDS)
            waiting = {name for name in waiting if self.decided(name) is None}


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
