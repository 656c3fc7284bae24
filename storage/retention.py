"""Retention of finished runs: which runs may go, and their deletion with every row that
refers to them (jobs.retention and dispatch.pruner say when).

A run may go once it is terminal and finished before the cutoff, and nothing needs it:
- no attempt of it is still running (a cancel that the worker has not seen yet);
- of a job that may run again (active or paused, not deleted), it is neither among the
  newest `pause_after_failures` failed or succeeded runs by `finished_at` (what that policy
  judges, jobs.services.LATEST_FINISHED: skipped and cancelled runs do not count there, so
  they do not push a failure out here either) nor the newest terminal run by
  `scheduled_for` (the API shows a job's last run whatever its age).
Runs that are not terminal (pending, queued, running, retry_wait) are never candidates.

Tables: `jobs_run`, `jobs_job`, `jobs_attempt`, `jobs_activerun`, `dispatch_effect`,
`dispatch_outboxmessage`, `jobs_auditevent`, `jobs_dependency_gate`.
"""

from __future__ import annotations

import datetime as dt
import uuid

from .sql import execute, fetch_all

RUN, JOB, ATTEMPT = "jobs_run", "jobs_job", "jobs_attempt"
AUDIT = "jobs_auditevent"
# Every table that refers to a run (or to an attempt, which goes with its run), children
# first: (table, its column holding the run's id).
RUN_ROWS = (
    # A dependent occurrence's gate names the run it decided: the gate goes with it (its
    # decision is the run's; a gate without its run has nothing left to tell).
    ("jobs_dependency_gate", "run_id"),
    ("jobs_activerun", "run_id"),
    ("dispatch_effect", "run_id"),
    ("dispatch_outboxmessage", "run_id"),
    (AUDIT, "run_id"),
    (ATTEMPT, "run_id"),
    (RUN, "id"),
)

# jobs.transitions.TERMINAL_RUN_STATES, sorted, as literals: the planner matches
# run_finished_idx's predicate only against the very same list.
TERMINAL = "('cancelled', 'failed', 'skipped', 'succeeded')"
MAY_RUN_AGAIN = "('active', 'paused')"  # jobs.models.JobState
JUDGED = "('failed', 'succeeded')"  # the states pause_after_failures judges
# How many of a job's newest terminal runs its policies need (validation: 1..1000 or null).
KEEP_NEWEST = "COALESCE(CAST(j.spec ->> 'pause_after_failures' AS integer), 1)"
# A job's failed or succeeded runs that finished after r (run_job_finished_idx), counted up
# to the number it keeps (an index walk of a few rows).
KEPT = f"""(SELECT count(*) FROM (
             SELECT 1 FROM {RUN} n
              WHERE n.job_id = r.job_id AND n.state IN {JUDGED}
                AND (n.finished_at, n.id) > (r.finished_at, r.id)
              LIMIT {KEEP_NEWEST}) AS newer)"""
NEWER_TERMINAL = f"""SELECT 1 FROM {RUN} n
                      WHERE n.job_id = r.job_id AND n.scheduled_for > r.scheduled_for
                        AND n.state IN {TERMINAL}"""
# The runs that may go (module docstring), oldest first; `runs_expired_claim` locks them.
EXPIRED_RUNS = f"""
SELECT r.id FROM {RUN} r JOIN {JOB} j ON j.id = r.job_id
 WHERE r.state IN {TERMINAL} AND r.finished_at < %(cutoff)s
   AND NOT EXISTS (SELECT 1 FROM {ATTEMPT} a
                    WHERE a.run_id = r.id AND a.state = 'running')
   AND NOT (j.state IN {MAY_RUN_AGAIN} AND j.deleted_at IS NULL
            AND ((r.state IN {JUDGED} AND {KEPT} < {KEEP_NEWEST})
                 OR NOT EXISTS ({NEWER_TERMINAL})))
 ORDER BY r.finished_at
 LIMIT %(limit)s"""


def runs_expired_claim(*, cutoff: dt.datetime, limit: int) -> list[uuid.UUID]:
    """The ids of up to `limit` runs finished before `cutoff` that may go (module
    docstring), oldest first, read through run_finished_idx and locked FOR UPDATE OF the
    run SKIP LOCKED (rows another transaction holds are passed over). Call in the
    transaction that deletes them."""
    rows = fetch_all(
        EXPIRED_RUNS + " FOR UPDATE OF r SKIP LOCKED", {"cutoff": cutoff, "limit": limit}
    )
    return [row[0] for row in rows]


def runs_delete_terminal(*, run_ids: list[uuid.UUID]) -> int:
    """Delete the terminal runs of `run_ids` (others stay, whatever the ids) with their
    attempts, outbox rows, effects, ActiveRun rows, audit events and dependency gates, in
    the caller's
    transaction; a run's logs are logs_app's, deleted first. An operator's action on the
    job (`job.*`, e.g. job.triggered naming the run it made) is the job's history, which
    stays: it only loses the link to the run. Row locks on every row deleted or unlinked.
    Plain DELETEs: these are all the tables that refer to a run or an attempt."""
    if not run_ids:
        return 0
    marks = ", ".join(["%s"] * len(run_ids))
    rows = fetch_all(f"SELECT id FROM {RUN} WHERE id IN ({marks}) AND state IN {TERMINAL}", run_ids)
    doomed = [run_id for (run_id,) in rows]
    if not doomed:
        return 0
    marks = ", ".join(["%s"] * len(doomed))
    execute(f"UPDATE {AUDIT} SET run_id = NULL WHERE run_id IN ({marks}) AND action LIKE 'job.%%'",
            doomed)  # fmt: skip
    deleted = 0
    for table, column in RUN_ROWS:
        deleted += execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", doomed)
    return deleted
