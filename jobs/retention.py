"""Retention of finished runs (docs/operations.md, "Retention"): their deletion with what
hangs off them in this layer (attempts, outbox rows, effects, audit events), counted in
scheduler_dead_letter_total when they had failed. Which runs may go is
storage.retention's rule (`runs_expired_claim`); run logs are logs_app's
(`logs_app.retention.run_logs_delete`); the pruner (dispatch.pruner) deletes both in one
transaction.

Runs that are not terminal (pending, queued, running, retry_wait: a retry is an attempt of
the same run) never go. Job rows, their versions and their own audit events (not a run's)
stay: they grow with a job's edits, not with its runs.
"""

from __future__ import annotations

from storage.retention import runs_delete_terminal

from .models import TallyDelta

# Failed runs deleted by retention, which scheduler_dead_letter_total adds to those kept:
# a tally (appended as a delta in the prune's transaction, rolled up with the others), so
# that /metrics reads it in the same statement, and the same snapshot, as the failed runs'
# tally (a prune between two reads would make the counter drop for one scrape, which
# Prometheus takes for a reset).
DEAD_LETTER_PRUNED = "scheduler_dead_letter_pruned"


def runs_delete(*, run_ids: list) -> int:
    """Delete these runs with their attempts, outbox rows, effects and audit events, in the
    caller's transaction (their logs first: logs_app.retention.run_logs_delete); the number
    of rows deleted. Only terminal runs go, whatever the ids (storage.retention)."""
    deleted = runs_delete_terminal(run_ids=run_ids)
    # scheduler_dead_letter_total counts failed runs: those pruned stay counted.
    if deleted.failed:
        TallyDelta.objects.create(name=DEAD_LETTER_PRUNED, count=deleted.failed)
    return deleted.rows
