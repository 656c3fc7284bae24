"""The dependencies step of the scheduler pass: ends of upstream runs -> dependent runs
(jobs.dependencies holds every decision; this is the loop's shape around it).

Three bounded batches, each in its own transaction: signals written by the trigger of
storage.dependencies (FOR UPDATE SKIP LOCKED, so replicas share them), gates whose
`within_seconds` passed (through their deadline index), and gates held while their job was
paused (through their index). The trigger NOTIFYs the schedulers at commit, so on an idle
system a dependent's run is created within a pass of its upstream's end.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db import transaction

from jobs.dependencies import (
    dependency_deadlines_apply,
    dependency_held_release,
    dependency_signals_apply,
)

from .config import config_require


@dataclasses.dataclass(frozen=True)
class DependenciesConfig:
    batch_size: int = 500  # signals (and gates) per transaction

    def __post_init__(self) -> None:
        config_require(self, at_least_one=("batch_size",))


@dataclasses.dataclass(frozen=True)
class DependenciesResult:
    signals: int = 0  # upstream run ends consumed
    runs_created: int = 0  # dependent runs queued
    runs_skipped: int = 0  # dependent occurrences recorded `skipped` (upstream:, misfire:)
    held: int = 0  # complete while their job was paused: decided on resume
    batch_full: bool = False


def dependencies_run_once(*, now: dt.datetime, config: DependenciesConfig) -> DependenciesResult:
    limit = config.batch_size
    with transaction.atomic():
        signals = dependency_signals_apply(now=now, limit=limit)
    with transaction.atomic():
        deadlines = dependency_deadlines_apply(now=now, limit=limit)
    with transaction.atomic():
        released = dependency_held_release(now=now, limit=limit)
    parts = (signals, deadlines, released)
    return DependenciesResult(
        signals=signals.signals,
        runs_created=sum(part.runs_created for part in parts),
        runs_skipped=sum(part.runs_skipped for part in parts),
        held=signals.held,
        batch_full=signals.signals >= limit,
    )
