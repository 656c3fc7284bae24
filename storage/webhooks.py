"""Webhook deliveries written in the transaction of the event they report.

Which webhooks hear of an event about a job: the webhooks of the job's owner that name the
event and either name no jobs or name this one. The rule is applied by
- the trigger `run_ended_notifies` (statement-level: the rule applied to every run the
  statement ended, in one INSERT), in the statement that ends a run `failed`
  (`run.undeliverable` when the relay gave up on its message, `run.failed` otherwise) or
  `succeeded` (`run.succeeded`, which only webhooks naming it hear of): so a delivery is
  committed with the run's terminal transition, or not at all;
- `webhook_deliveries_record_for_job`, for the events decided in Python (a job paused
  after failures), in the caller's transaction.

Both installed by the jobs migration that creates the webhook tables.
"""

import datetime as dt
import uuid

from .ddl import Ddl
from .sql import fetch_value

WEBHOOK_EVENTS = Ddl(
    create="""
CREATE FUNCTION scheduler_webhook_event_record(
    p_event text, p_job_id uuid, p_run_id uuid, p_now timestamptz
) RETURNS integer LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    recorded integer;
BEGIN
    INSERT INTO jobs_webhookdelivery
        (id, webhook_id, event, job_id, run_id, body, state, created_at, next_attempt_at,
         attempt_count)
    SELECT gen_random_uuid(), webhook.id, p_event, p_job_id, p_run_id, '', 'pending', p_now,
           p_now, 0
      FROM jobs_job job
      JOIN jobs_webhook webhook ON webhook.owner_id = job.owner_id
     WHERE job.id = p_job_id
       AND p_event = ANY (webhook.events)
       AND (webhook.jobs IS NULL OR p_job_id = ANY (webhook.jobs));
    GET DIAGNOSTICS recorded = ROW_COUNT;
    IF recorded > 0 THEN
        PERFORM pg_notify('scheduler_webhooks', '');
    END IF;
    RETURN recorded;
END $$;

-- Statement-level, on the transition tables (which the state tallies' trigger on jobs_run
-- collects anyway): a statement ending many runs (the worker's packed successes, a
-- multi-run cancel) writes their deliveries in one INSERT, and a system without webhooks
-- pays one probe of an empty table per statement.
CREATE FUNCTION scheduler_runs_ended_notify() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    recorded integer;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jobs_webhook) THEN
        RETURN NULL;
    END IF;
    INSERT INTO jobs_webhookdelivery
        (id, webhook_id, event, job_id, run_id, body, state, created_at, next_attempt_at,
         attempt_count)
    SELECT gen_random_uuid(), webhook.id, ended.event, ended.job_id, ended.id, '',
           'pending', STATEMENT_TIMESTAMP(), STATEMENT_TIMESTAMP(), 0
      FROM (SELECT run.id, run.job_id,
                   CASE WHEN run.state = 'succeeded' THEN 'run.succeeded'
                        WHEN run.failure_reason = 'undeliverable' THEN 'run.undeliverable'
                        ELSE 'run.failed' END AS event
              FROM new_runs run JOIN old_runs before ON before.id = run.id
             WHERE run.state IN ('failed', 'succeeded')
               AND before.state IS DISTINCT FROM run.state) ended
      JOIN jobs_job job ON job.id = ended.job_id
      JOIN jobs_webhook webhook ON webhook.owner_id = job.owner_id
     WHERE ended.event = ANY (webhook.events)
       AND (webhook.jobs IS NULL OR ended.job_id = ANY (webhook.jobs));
    GET DIAGNOSTICS recorded = ROW_COUNT;
    IF recorded > 0 THEN
        PERFORM pg_notify('scheduler_webhooks', '');
    END IF;
    RETURN NULL;
END $$;
-- PostgreSQL allows no column list with transition tables: every UPDATE of jobs_run.
CREATE TRIGGER run_ended_notifies AFTER UPDATE ON jobs_run
    REFERENCING OLD TABLE AS old_runs NEW TABLE AS new_runs FOR EACH STATEMENT
    EXECUTE FUNCTION scheduler_runs_ended_notify();
""",
    drop="""
DROP TRIGGER run_ended_notifies ON jobs_run;
DROP FUNCTION scheduler_runs_ended_notify();
DROP FUNCTION scheduler_webhook_event_record(text, uuid, uuid, timestamptz);
""",
)


def webhook_deliveries_record_for_job(
    *, event: str, job_id: uuid.UUID, run_id: uuid.UUID | None, now: dt.datetime
) -> int:
    """A pending delivery of `event` (about this job, and run if any) for each webhook the
    rule picks (`scheduler_webhook_event_record`); how many.

    Runs in the caller's transaction (the event's own), takes no lock but the inserted
    rows'."""
    return fetch_value(
        "SELECT scheduler_webhook_event_record(%s, %s, %s, %s)", [event, job_id, run_id, now]
    )
