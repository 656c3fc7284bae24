"""The pruner: deletes what has outlived its retention, one bounded batch of each per call.

- Idempotency keys older than `jobs.idempotency.IDEMPOTENCY_RETENTION` (24 h).
- Run logs (chunks, their stored content, manifests) of attempts finished more than
  `SCHEDULER_LOG_RETENTION_DAYS` ago (`logs_app.retention.logs_prune`; a running attempt's
  logs never are).

`manage.py scheduler` runs it in a loop of its own (every `poll_interval`, at once again
while a batch was full); `manage.py prune_logs` loops the logs part until nothing is left.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db import transaction

from jobs.idempotency import idempotency_prune
from logs_app.retention import logs_prune

from .config import config_require


@dataclasses.dataclass(frozen=True)
class PrunerConfig:
    batch_size: int = 500  # idempotency keys, and log chunks (then manifests), per call
    poll_interval: float = 60.0  # retention is counted in hours and days: no hurry
    # None: the SCHEDULER_LOG_RETENTION_DAYS setting.
    logs_retention_days: int | None = None

    def __post_init__(self) -> None:
        config_require(
            self,
            at_least_one=("batch_size",),
            positive=("poll_interval",),
            non_negative=("logs_retention_days",),
        )


@dataclasses.dataclass(frozen=True)
class PrunerResult:
    idempotency_keys_pruned: int = 0
    logs_pruned: int = 0  # chunks and manifests
    batch_full: bool = False


def pruner_run_once(*, now: dt.datetime, config: PrunerConfig) -> PrunerResult:
    with transaction.atomic():
        keys = idempotency_prune(now=now, limit=config.batch_size)
    # Not in one transaction: stored content is deleted as it goes, and cannot roll back.
    logs = logs_prune(
        now=now, retention_days=config.logs_retention_days, batch_size=config.batch_size
    )
    return PrunerResult(
        idempotency_keys_pruned=keys,
        logs_pruned=logs,
        batch_full=max(keys, logs) >= config.batch_size,
    )
