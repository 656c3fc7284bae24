"""Dependencies between jobs: the trigger that signals a run's end to its job's dependents,
and the lock that serializes changes of the dependency graph.

The trigger `run_ended_signals_dependents` fires in the statement that puts a run in a
terminal state (the worker's success or failure, the reaper, the relay's undeliverable, a
cancel) and on the insert of a run created terminal (a `skipped` run: misfire, overlap, or
a skip from upstream, so skips propagate down a chain). For a job that has dependents (one
probe of `job_dependency_upstream_idx`; none: nothing written) it inserts a
`jobs_dependency_signal` row in that same transaction and wakes the schedulers
(NOTIFY on `scheduler_schedule`), so no path that ends a run can miss it and a crash at
any instant neither loses nor doubles it. The scheduler's dependencies step consumes the
signals (dispatch.dependencies). Installed by jobs/migrations/0004_dependencies.py.
"""

from .ddl import Ddl
from .sql import execute

ACTIVE = "('pending', 'queued', 'retry_wait', 'running')"
TERMINAL = "('cancelled', 'failed', 'skipped', 'succeeded')"

RUN_ENDED_SIGNALS_DEPENDENTS = Ddl(
    create=f"""
CREATE FUNCTION scheduler_run_ended_signals_dependents() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM jobs_dependency WHERE upstream_id = NEW.job_id) THEN
        INSERT INTO jobs_dependency_signal (run_id, job_id, state, kind, scheduled_for, created_at)
        VALUES (NEW.id, NEW.job_id, NEW.state, NEW.kind, NEW.scheduled_for, clock_timestamp());
        PERFORM pg_notify('scheduler_schedule', '');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER run_ended_signals_dependents AFTER UPDATE OF state ON jobs_run FOR EACH ROW
    WHEN (OLD.state IN {ACTIVE} AND NEW.state IN {TERMINAL})
    EXECUTE FUNCTION scheduler_run_ended_signals_dependents();
CREATE TRIGGER run_created_ended_signals_dependents AFTER INSERT ON jobs_run FOR EACH ROW
    WHEN (NEW.state IN {TERMINAL})
    EXECUTE FUNCTION scheduler_run_ended_signals_dependents();
""",
    drop="""
DROP TRIGGER run_created_ended_signals_dependents ON jobs_run;
DROP TRIGGER run_ended_signals_dependents ON jobs_run;
DROP FUNCTION scheduler_run_ended_signals_dependents();
""",
)

# The advisory lock key of the dependency graph (an arbitrary constant of this project).
GRAPH_LOCK_KEY = 7_231_123


def dependency_graph_lock() -> None:
    """Take the transaction-level advisory lock of the dependency graph: two edits that
    would together close a cycle (A after B, B after A) run one after the other, and the
    second sees the first's edges. Runs in the caller's transaction; held until it ends."""
    execute("SELECT pg_advisory_xact_lock(%s)", [GRAPH_LOCK_KEY])
