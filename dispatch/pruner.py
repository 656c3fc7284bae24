"""The pruner: deletes what has outlived its retention, in bounded batches per call.

- Finished runs with their attempts, outbox rows, effects, audit events and run logs,
  `SCHEDULER_RUN_RETENTION_DAYS` after they finished (`storage.retention`: never a run
  that is not terminal, nor the newest runs a job's policies need); up to `run_batches` batches of
  `run_batch_size` runs, each in its own transaction, found through run_finished_idx.
- Idempotency keys older than `jobs.idempotency.IDEMPOTENCY_RETENTION` (24 h).
- Throttle windows that have ended (`storage.throttle`): one row per scope and user, per
  client address for the admin's login, deleted once it counts nothing current.
- Run logs (chunks, their stored content, manifests) of attempts finished more than
  `SCHEDULER_LOG_RETENTION_DAYS` ago (`logs_app.retention.logs_prune`; a running attempt's
  logs never are).
- Webhook deliveries delivered or abandoned, `SCHEDULER_RUN_RETENTION_DAYS` after their
  event, with their attempts (`jobs.webhooks.webhook_deliveries_prune`; pending ones never).
- The tallies' deltas (`storage.tallies`), rolled up into one row per series: up to
  `tally_batches` transactions of `tally_batch_size` deltas, so what /metrics sums stays
  about one interval's events.

`manage.py scheduler` runs it in a loop of its own (every `poll_interval`, `--prune-interval`,
at once again while a batch was full); `manage.py prune_logs` loops the logs part until
nothing is left.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.conf import settings
from django.db import transaction

from jobs.idempotency import idempotency_prune
from jobs.retention import runs_delete
from jobs.webhooks import webhook_deliveries_prune
from logs_app.retention import logs_prune, run_logs_delete
from logs_app.store import stored_content_delete
from storage.retention import runs_expired_claim
from storage.tallies import tallies_roll_up
from storage.throttle import throttle_windows_delete_ended

from .config import config_require


@dataclasses.dataclass(frozen=True)
class PrunerConfig:
    # Idempotency keys, throttle windows, and log chunks (then manifests), per call.
    batch_size: int = 500
    poll_interval: float = 60.0  # retention is counted in hours and days: no hurry
    # None: the SCHEDULER_LOG_RETENTION_DAYS setting.
    logs_retention_days: int | None = None
    # None: the SCHEDULER_RUN_RETENTION_DAYS setting (fractions allowed).
    run_retention_days: float | None = None
    # Runs per transaction (each with its attempts, outbox rows, effects, audit events and
    # logs: a few thousand rows), and transactions per call: a backlog after an upgrade
    # drains in steps that hold no lock for long.
    run_batch_size: int = 1000
    run_batches: int = 5
    # Tally deltas rolled up per transaction, and transactions per call: a busy minute
    # appends some 10 deltas per run.
    tally_batch_size: int = 20_000
    tally_batches: int = 10

    def __post_init__(self) -> None:
        config_require(
            self,
            at_least_one=(
                "batch_size",
                "run_batch_size",
                "run_batches",
                "tally_batch_size",
                "tally_batches",
            ),
            positive=("poll_interval", "run_retention_days"),
            non_negative=("logs_retention_days",),
        )


@dataclasses.dataclass(frozen=True)
class PrunerResult:
    runs_pruned: int = 0
    run_rows_pruned: int = 0  # runs and their attempts, outbox rows, effects, audit, logs
    idempotency_keys_pruned: int = 0
    throttle_windows_pruned: int = 0
    logs_pruned: int = 0  # chunks and manifests
    webhook_deliveries_pruned: int = 0
    tally_deltas_rolled_up: int = 0
    batch_full: bool = False


def pruner_run_once(*, now: dt.datetime, config: PrunerConfig) -> PrunerResult:
    runs, rows, runs_full = _prune_runs(now=now, config=config)
    deltas, deltas_full = _roll_up_tallies(config=config)
    with transaction.atomic():
        keys = idempotency_prune(now=now, limit=config.batch_size)
    windows = throttle_windows_delete_ended(now=now, limit=config.batch_size)
    with transaction.atomic():
        deliveries = webhook_deliveries_prune(
            cutoff=now - _run_retention(config), limit=config.batch_size
        )
    # Not in one transaction: stored content is deleted as it goes, and cannot roll back.
    logs = logs_prune(
        now=now, retention_days=config.logs_retention_days, batch_size=config.batch_size
    )
    return PrunerResult(
        runs_pruned=runs,
        run_rows_pruned=rows,
        idempotency_keys_pruned=keys,
        throttle_windows_pruned=windows,
        logs_pruned=logs,
        tally_deltas_rolled_up=deltas,
        webhook_deliveries_pruned=deliveries,
        batch_full=runs_full
        or deltas_full
        or max(keys, windows, logs, deliveries) >= config.batch_size,
    )


def _roll_up_tallies(*, config: PrunerConfig) -> tuple[int, bool]:
    """(deltas rolled up, whether the last batch was full)."""
    deltas = 0
    for _ in range(config.tally_batches):
        with transaction.atomic():
            rolled = tallies_roll_up(limit=config.tally_batch_size)
        deltas += rolled
        if rolled < config.tally_batch_size:
            return deltas, False
    return deltas, True


def _run_retention(config: PrunerConfig) -> dt.timedelta:
    days = config.run_retention_days
    return dt.timedelta(days=settings.SCHEDULER_RUN_RETENTION_DAYS if days is None else days)


def _prune_runs(*, now: dt.datetime, config: PrunerConfig) -> tuple[int, int, bool]:
    """(runs deleted, rows deleted, whether the last batch was full)."""
    retention = _run_retention(config)
    runs = rows = 0
    for _ in range(config.run_batches):
        with transaction.atomic():
            ids = runs_expired_claim(cutoff=now - retention, limit=config.run_batch_size)
            log_rows, stored = run_logs_delete(run_ids=ids)
            rows += log_rows + runs_delete(run_ids=ids)
        stored_content_delete(stored)  # after the commit: a rollback keeps the content
        runs += len(ids)
        if len(ids) < config.run_batch_size:
            return runs, rows, False
    return runs, rows, True
