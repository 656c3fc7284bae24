"""Retention of finished runs (docs/operations.md, "Retention"): which runs may go, and
their deletion with what hangs off them in this layer (attempts, outbox rows, effects,
audit events). Run logs are logs_app's (`logs_app.retention.run_logs_delete`); the pruner
(dispatch.pruner) deletes both in one transaction.

A run may go once it is terminal and finished before the cutoff, and nothing needs it:
- no attempt of it is still running (a cancel that the worker has not seen yet);
- of a job that may run again (active or paused, not deleted), it is neither among the
  newest `pause_after_failures` failed or succeeded runs by `finished_at` (what that policy
  judges, jobs.services.LATEST_FINISHED: skipped and cancelled runs do not count there, so
  they do not push a failure out here either) nor the newest terminal run by
  `scheduled_for` (the API shows a job's last run whatever its age).
Runs that are not terminal (pending, queued, running, retry_wait: a retry is an attempt of
the same run) are never candidates. Job rows, their versions and their own audit events
(not a run's) stay: they grow with a job's edits, not with its runs.
"""

from __future__ import annotations

import datetime as dt

from django.db import IntegrityError, connection, transaction
from django.db.models import F

from .models import (
    ActiveRun,
    Attempt,
    AttemptState,
    AuditEvent,
    Effect,
    Job,
    JobState,
    OutboxMessage,
    Run,
    RunState,
    Tally,
)
from .transitions import TERMINAL_RUN_STATES

# Failed runs deleted by retention, which scheduler_dead_letter_total adds to those kept:
# a row of jobs_tally (shard 0), so that /metrics reads it in the same statement, and the
# same snapshot, as the failed runs' tally (a prune between two reads would make the
# counter drop for one scrape, which Prometheus takes for a reset).
DEAD_LETTER_PRUNED = "scheduler_dead_letter_pruned"


def _dead_letter_pruned_add(count: int) -> None:
    """Add `count` in the caller's transaction (the prune's)."""
    if Tally.objects.filter(name=DEAD_LETTER_PRUNED, labels="", shard=0).update(
        count=F("count") + count
    ):
        return
    try:
        with transaction.atomic():
            Tally.objects.create(name=DEAD_LETTER_PRUNED, labels="", shard=0, count=count)
    except IntegrityError:  # another pruner created it first
        Tally.objects.filter(name=DEAD_LETTER_PRUNED, labels="", shard=0).update(
            count=F("count") + count
        )


def _sql_in(values) -> str:
    # Enum values, not user input; sorted, so the planner matches run_finished_idx's predicate.
    return "(" + ", ".join(f"'{value}'" for value in sorted(values)) + ")"


TERMINAL = _sql_in(TERMINAL_RUN_STATES)
MAY_RUN_AGAIN = _sql_in({JobState.ACTIVE, JobState.PAUSED})
# How many of a job's newest terminal runs its policies need (validation: 1..1000 or null).
KEEP_NEWEST = "COALESCE(CAST(j.spec ->> 'pause_after_failures' AS integer), 1)"

JUDGED = _sql_in({RunState.FAILED, RunState.SUCCEEDED})
# A job's failed or succeeded runs that finished after r (run_job_finished_idx).
NEWER_JUDGED = f"""SELECT 1 FROM {Run._meta.db_table} n
                    WHERE n.job_id = r.job_id AND n.state IN {JUDGED}
                      AND (n.finished_at, n.id) > (r.finished_at, r.id)"""
NEWER_TERMINAL = f"""SELECT 1 FROM {Run._meta.db_table} n
                      WHERE n.job_id = r.job_id AND n.scheduled_for > r.scheduled_for
                        AND n.state IN {TERMINAL}"""
# PostgreSQL stops counting a job's newer runs at the number it keeps (an index walk of a
# few rows); SQLite cannot limit by an outer column, and counts them (embedded: small).
KEPT = {
    "postgresql": f"(SELECT count(*) FROM ({NEWER_JUDGED} LIMIT {KEEP_NEWEST}) AS newer)",
    "sqlite": f"(SELECT count(*) FROM ({NEWER_JUDGED}) AS newer)",
}
EXPIRED_RUNS = f"""
SELECT r.id FROM {Run._meta.db_table} r JOIN {Job._meta.db_table} j ON j.id = r.job_id
 WHERE r.state IN {TERMINAL} AND r.finished_at < %(cutoff)s
   AND NOT EXISTS (SELECT 1 FROM {Attempt._meta.db_table} a
                    WHERE a.run_id = r.id AND a.state = '{AttemptState.RUNNING}')
   AND NOT (j.state IN {MAY_RUN_AGAIN} AND j.deleted_at IS NULL
            AND ((r.state IN {JUDGED} AND {{kept}} < {KEEP_NEWEST})
                 OR NOT EXISTS ({NEWER_TERMINAL})))
 ORDER BY r.finished_at
 LIMIT %(limit)s"""


def runs_expired_claim(*, now: dt.datetime, retention: dt.timedelta, limit: int) -> list:
    """Lock and return the ids of up to `limit` runs that may go (module docstring), oldest
    first, through run_finished_idx; rows another transaction holds are passed over. Call
    in the transaction that deletes them."""
    sql = EXPIRED_RUNS.format(kept=KEPT.get(connection.vendor, KEPT["sqlite"]))
    if connection.vendor == "postgresql":
        sql += " FOR UPDATE OF r SKIP LOCKED"
    with connection.cursor() as cursor:
        cursor.execute(sql, {"cutoff": now - retention, "limit": limit})
        return [row[0] for row in cursor.fetchall()]


def runs_delete(*, run_ids: list) -> int:
    """Delete these runs with their attempts, outbox rows, effects and audit events, in the
    caller's transaction (their logs first: logs_app.retention.run_logs_delete); the number
    of rows deleted. Only terminal runs go, whatever the ids."""
    if not run_ids:
        return 0
    marks = ", ".join(["%s"] * len(run_ids))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, state FROM {Run._meta.db_table}"
            f" WHERE id IN ({marks}) AND state IN {TERMINAL}",
            run_ids,
        )
        rows = cursor.fetchall()
        doomed = [run_id for run_id, _ in rows]
        if not doomed:
            return 0
        marks = ", ".join(["%s"] * len(doomed))
        # scheduler_dead_letter_total counts failed runs: those pruned stay counted.
        failed = sum(state == RunState.FAILED for _, state in rows)
        if failed:
            _dead_letter_pruned_add(failed)
        # An operator's action on the job (job.triggered names the run it made) is the
        # job's history, which stays: it only loses the link to the run.
        cursor.execute(
            f"UPDATE {AuditEvent._meta.db_table} SET run_id = NULL"
            f" WHERE run_id IN ({marks}) AND action LIKE 'job.%%'",
            doomed,
        )
        deleted = 0
        # The ORM's delete() would first read every related row to cascade by hand; these
        # are all the tables that refer to a run or an attempt, so plain DELETEs do.
        for table, column in (
            (ActiveRun._meta.db_table, "run_id"),
            (Effect._meta.db_table, "run_id"),
            (OutboxMessage._meta.db_table, "run_id"),
            (AuditEvent._meta.db_table, "run_id"),
            (Attempt._meta.db_table, "run_id"),
            (Run._meta.db_table, "id"),
        ):
            cursor.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", doomed)
            deleted += cursor.rowcount
    return deleted
