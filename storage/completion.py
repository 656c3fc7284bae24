"""Job completion: active -> completed for a job whose schedule is over (a one-time job after
its run, a job past end_at) once none of its runs is active.

The rule is written once, in the SQL function `scheduler_job_complete_if_finished`, and
called from two places:
- the trigger `run_ended_completes_job`, in the statement that ends a run (the worker's
  success, a failure, the reaper, a cancel): transactional with the run's terminal
  transition, so no crash loses it;
- `jobs_complete_if_finished`, the completer's safety net (dispatch.completer) for the jobs
  the trigger left: two runs ending together each seeing the other active, a job whose
  row the trigger found locked, a job past end_at without a run.

Both are installed by jobs/migrations/0003_job_completion_trigger.py.
"""

import datetime as dt
import uuid

from .ddl import Ddl
from .sql import fetch_all

ACTIVE = "('pending', 'queued', 'retry_wait', 'running')"
TERMINAL = "('cancelled', 'failed', 'skipped', 'succeeded')"

# The rule, written once. `spare` empty: as jobs/migrations/0003 installed it. A job of
# schedule kind `after` has no next_run_at and is never over (its runs come from its
# upstreams' ends: jobs.dependencies), so JOB_COMPLETION_SPARES_AFTER (installed by
# jobs/migrations/0004_dependencies.py, its drop restoring the first form) leaves it active.
_COMPLETE_IF_FINISHED = """
CREATE OR REPLACE FUNCTION scheduler_job_complete_if_finished(p_job_id uuid, p_now timestamptz)
    RETURNS boolean LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    PERFORM 1 FROM jobs_job
     WHERE id = p_job_id AND state = 'active' AND next_run_at IS NULL AND deleted_at IS NULL
       {spare}
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND OR EXISTS (SELECT 1 FROM jobs_run
                             WHERE job_id = p_job_id AND state IN {active}) THEN
        RETURN false;
    END IF;
    UPDATE jobs_job SET state = 'completed', updated_at = p_now WHERE id = p_job_id;
    INSERT INTO jobs_auditevent (created_at, actor_label, action, job_id, data)
    VALUES (p_now, 'system:scheduler', 'job.completed', p_job_id, '{{}}');
    RETURN true;
END $$;
"""
# The job's row is taken SKIP LOCKED: a trigger or backfill that holds it is about to add a
# run, and the completer's safety net looks again later. Its runs are read after the lock,
# in a statement of their own (a new snapshot): a run its previous holder added is seen.
# About one primary key probe per call (none locked for a recurring job: its next_run_at is
# set).
JOB_COMPLETION = Ddl(
    create=_COMPLETE_IF_FINISHED.format(spare="", active=ACTIVE)
    + f"""
-- A run that just ended completes its job, in the statement that ended it; a run ending
-- while another of its job is still active leaves the job to that one's ending.
CREATE FUNCTION scheduler_run_ended_completes_job() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    PERFORM scheduler_job_complete_if_finished(NEW.job_id, STATEMENT_TIMESTAMP());
    RETURN NULL;
END $$;
CREATE TRIGGER run_ended_completes_job AFTER UPDATE OF state ON jobs_run FOR EACH ROW
    WHEN (OLD.state IN {ACTIVE} AND NEW.state IN {TERMINAL})
    EXECUTE FUNCTION scheduler_run_ended_completes_job();
""",
    drop="""
DROP TRIGGER run_ended_completes_job ON jobs_run;
DROP FUNCTION scheduler_run_ended_completes_job();
DROP FUNCTION scheduler_job_complete_if_finished(uuid, timestamptz);
""",
)


JOB_COMPLETION_SPARES_AFTER = Ddl(
    create=_COMPLETE_IF_FINISHED.format(
        spare="AND spec->'schedule'->>'kind' IS DISTINCT FROM 'after'", active=ACTIVE
    ),
    drop=_COMPLETE_IF_FINISHED.format(spare="", active=ACTIVE),
)


def jobs_complete_if_finished(*, job_ids: list[uuid.UUID], now: dt.datetime) -> list[uuid.UUID]:
    """Complete each of these jobs whose schedule is over and none of whose runs is active
    (the trigger's rule, `scheduler_job_complete_if_finished`), with its `job.completed`
    audit event at `now`; the ids of those completed, in the order given.

    Runs in the caller's transaction; takes each job's row lock (FOR NO KEY UPDATE SKIP
    LOCKED: a job whose row another transaction holds is left for a later pass), kept until
    the caller commits."""
    if not job_ids:
        return []
    rows = fetch_all(
        "SELECT job.id FROM unnest(%s::uuid[]) WITH ORDINALITY AS job (id, position)"
        " WHERE scheduler_job_complete_if_finished(job.id, %s) ORDER BY job.position",
        [list(job_ids), now],
    )
    return [job_id for (job_id,) in rows]
