"""The memory of backfills (jobs.models.BackfilledOccurrences, jobs.services.job_backfill):
which occurrences of a job a backfill has run, kept after retention deletes the runs.

Tables: `jobs_backfilledoccurrences`, `jobs_run`.
"""

from .ddl import Ddl

# The backfill runs already there when the table is created: one row each (an upgrade's
# one-off; backfills from then on remember each run of evenly spaced instants in one row).
BACKFILLED_FROM_RUNS = Ddl(
    create="""
INSERT INTO jobs_backfilledoccurrences (job_id, first, last, step)
SELECT job_id, scheduled_for, scheduled_for, interval '0'
  FROM jobs_run WHERE kind = 'backfill';
""",
    drop="DELETE FROM jobs_backfilledoccurrences;",
)
