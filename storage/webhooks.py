"""Webhook deliveries written in the transaction of the event they report.

The rule of which webhooks hear of an event about a job is written once, in the SQL
function `scheduler_webhook_event_record`: the webhooks of the job's owner that name the
event and either name no jobs or name this one. It is called from
- the trigger `run_ended_notifies`, in the statement that ends a run `failed`
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

CREATE FUNCTION scheduler_run_ended_notifies() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    PERFORM scheduler_webhook_event_record(
        CASE WHEN NEW.state = 'succeeded' THEN 'run.succeeded'
             WHEN NEW.failure_reason = 'undeliverable' THEN 'run.undeliverable'
             ELSE 'run.failed' END,
        NEW.job_id, NEW.id, STATEMENT_TIMESTAMP());
    RETURN NULL;
END $$;
CREATE TRIGGER run_ended_notifies AFTER UPDATE OF state ON jobs_run FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN ('failed', 'succeeded'))
    EXECUTE FUNCTION scheduler_run_ended_notifies();
""",
    drop="""
DROP TRIGGER run_ended_notifies ON jobs_run;
DROP FUNCTION scheduler_run_ended_notifies();
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
