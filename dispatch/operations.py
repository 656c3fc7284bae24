"""The bulk operations' loop step (jobs.operations does the work), run by every relay
between its own steps: no new process to deploy, and an operation goes on after any crash
(its items not yet done are still there). One bounded batch per step, in a transaction of
its own, so the locks it takes on runs and jobs last one batch and the relay's publishing
waits at most one batch."""

from __future__ import annotations

import dataclasses
import datetime as dt

from jobs.operations import operations_run_batch

from .config import config_require


@dataclasses.dataclass(frozen=True)
class OperationsConfig:
    # Items of one operation done in one transaction (each a single action's transition).
    batch_size: int = 100
    poll_interval: float = 1.0

    def __post_init__(self) -> None:
        config_require(self, positive=("batch_size", "poll_interval"))


@dataclasses.dataclass(frozen=True)
class OperationsResult:
    done: int
    batch_full: bool


def operations_run_once(*, now: dt.datetime, config: OperationsConfig) -> OperationsResult:
    """One batch of the oldest running bulk operation with items left."""
    done = operations_run_batch(now=now, batch_size=config.batch_size)
    return OperationsResult(done=done, batch_full=done >= config.batch_size)
