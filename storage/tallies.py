"""The tallies: metrics the database keeps as the events commit, by trigger.

The triggers only append: each firing INSERTs its additions as rows of `jobs_tally_delta`
and never updates a shared row, so a tally takes no row lock anyone waits on (no deadlock
between a claim and a cancel, no claim held behind a long transaction, no ceiling on the
hot path). `tallies_roll_up` (the pruner's) adds old deltas into the one row per series of
`jobs_tally` and deletes them; a reader adds the rolled-up rows and the pending deltas
(`storage.metrics.tallies_sum`; docs/operations.md, "Metrics"). No process keeps a count in
memory, a SIGKILL loses nothing that committed, no extra statement is sent by anyone, and
every path (worker, reaper, reconciler, admin) counts alike.

- `STAGE_HISTOGRAMS`: the stage lags, the run duration (histograms of fixed BUCKETS) and
  the attempts by outcome (`scheduler_attempts_total`), by row triggers on jobs_run and
  jobs_attempt.
- `DEAD_LETTER_TALLY`: runs as they end failed (`scheduler_dead_letter_total`), by a row
  trigger on jobs_run: a counter that a replay or retention never lowers.
- `STATE_TALLIES`: the runs by state (`scheduler_runs`) and the outbox backlog
  (`scheduler_outbox_backlog`), by statement triggers with transition tables, started from
  the rows already there.

All three are installed by jobs/migrations/0002_tally_triggers.py.
"""

from .ddl import Ddl
from .sql import fetch_value

# The buckets (upper bounds, seconds) the histograms count in; a reader exports them even
# while empty, so every histogram has the same series from its first scrape.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
           300.0, 900.0, 3600.0, 21600.0, 86400.0)  # fmt: skip

DISCOVERY_LAG = "scheduler_discovery_lag_seconds"
PUBLISH_LAG = "scheduler_publish_lag_seconds"
QUEUE_WAIT = "scheduler_queue_wait_seconds"
RUN_DURATION = "scheduler_run_duration_seconds"
ATTEMPTS = "scheduler_attempts_total"
RUNS_BY_STATE = "scheduler_runs"
OUTBOX_BACKLOG = "scheduler_outbox_backlog"
DEAD_LETTERS = "scheduler_dead_letter_total"
# Before DEAD_LETTERS: the failed runs retention deleted, added to the failed runs kept.
DEAD_LETTERS_PRUNED = "scheduler_dead_letter_pruned"

RUN_TABLE = "jobs_run"
ATTEMPT_TABLE = "jobs_attempt"
OUTBOX_TABLE = "dispatch_outboxmessage"
TALLY_TABLE = "jobs_tally"  # the rolled-up rows, one per series (shard 0)
DELTA_TABLE = "jobs_tally_delta"  # what the triggers append


# -- the stage histograms and the attempts by outcome -----------------------------------


def _bucket(seconds: str) -> str:
    """SQL: the `le` label of the bucket `seconds` falls in."""
    whens = " ".join(f"WHEN {seconds} <= {b!r} THEN 'le=\"{b!r}\"'" for b in BUCKETS)
    return f"CASE {whens} ELSE 'le=\"+Inf\"' END"


def _seconds(end: str, start: str) -> str:
    return f"GREATEST(EXTRACT(EPOCH FROM {end} - {start})::float8, 0)"


def _add(name: str, labels: str, n: str = "1", total: str = "v_seconds") -> str:
    """PL/pgSQL: append one delta to a tally (an INSERT: no lock on a shared row)."""
    return f"""
        INSERT INTO {DELTA_TABLE} (name, labels, count, total)
        VALUES ('{name}', {labels}, {n}, {total});"""


def _observe(name: str, seconds: str) -> str:
    return f"""
        v_seconds := {seconds};
        v_bucket := {_bucket("v_seconds")};""" + _add(name, "v_bucket")


RELEASED = "OLD.state = 'pending' AND NEW.state = 'queued'"  # by the promoter
FIRST_CLAIM = "OLD.started_at IS NULL AND NEW.started_at IS NOT NULL"
FINISHED = "OLD.finished_at IS NULL AND NEW.finished_at IS NOT NULL AND NEW.started_at IS NOT NULL"
# A run moves running -> succeeded only with its attempt, in the same statement or
# transaction (jobs.transitions): the run's trigger counts that attempt, so the success path
# fires one trigger; attempts ending otherwise are counted by the attempt's own trigger.
SUCCEEDED = "OLD.state = 'running' AND NEW.state = 'succeeded'"
SUCCEEDED_LABEL = "'outcome=\"succeeded\"'"
# An attempt that ended otherwise, unless released unstarted (`Attempt.released`: a pack's
# reserved attempt its worker never reached, docs/semantics.md, "Packed deliveries"): it
# never ran, so it is not counted as lost.
ATTEMPT_ENDED = "OLD.state = 'running' AND NEW.state NOT IN ('running', 'succeeded')"
ATTEMPT_COUNTED = f"{ATTEMPT_ENDED} AND NOT NEW.released"
DECLARE = """DECLARE
    v_seconds float8;
    v_bucket text;"""

_LAGS = (
    f"SELECT {_seconds('created_at', 'due_at')} AS lag FROM inserted_runs WHERE state = 'queued'"
)
_PUBLISHED_SINCE = "GREATEST(NEW.created_at, NEW.due_at)"
_UPDATED = f"""
    IF {RELEASED} THEN{_observe(DISCOVERY_LAG, _seconds("NEW.updated_at", "NEW.due_at"))}
    END IF;
    IF {FIRST_CLAIM} AND NEW.published_at IS NOT NULL THEN{
    _observe(PUBLISH_LAG, _seconds("NEW.published_at", _PUBLISHED_SINCE))
}{_observe(QUEUE_WAIT, _seconds("NEW.started_at", "NEW.published_at"))}
    END IF;
    IF {FINISHED} THEN{_observe(RUN_DURATION, _seconds("NEW.finished_at", "NEW.started_at"))}
    END IF;
    IF {SUCCEEDED} THEN{_add(ATTEMPTS, SUCCEEDED_LABEL, total="0")}
    END IF;"""

# PL/pgSQL triggers on generic plans kept for the session (a SQL function's body is planned
# at every call, and PL/pgSQL's own choice kept re-planning custom plans), each observation
# one appended delta row. Row triggers: a packed success of N runs appends N rows, but
# takes no lock that another statement could hold in another order. The attempts
# that finished before the triggers start the counter, so installing them on a database
# with history does not read as a counter reset.
STAGE_HISTOGRAMS = Ddl(
    create=f"""
INSERT INTO {TALLY_TABLE} (name, labels, shard, count, total)
SELECT '{ATTEMPTS}', 'outcome="' || state || '"', 0, count(*), 0
  FROM {ATTEMPT_TABLE} WHERE state <> 'running' AND NOT released GROUP BY state;

-- Runs inserted queued (the materializer's batches, triggers, backfills): due -> created,
-- one statement per INSERT of runs.
CREATE FUNCTION scheduler_runs_inserted() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    INSERT INTO {DELTA_TABLE} (name, labels, count, total)
    SELECT '{DISCOVERY_LAG}', {_bucket("lag")}, count(*), sum(lag)
      FROM ({_LAGS}) AS lags GROUP BY 2;
    RETURN NULL;
END $$;
CREATE TRIGGER run_measure_insert AFTER INSERT ON {RUN_TABLE}
    REFERENCING NEW TABLE AS inserted_runs FOR EACH STATEMENT
    EXECUTE FUNCTION scheduler_runs_inserted();

CREATE FUNCTION scheduler_run_updated() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
{DECLARE}
BEGIN{_UPDATED}
    RETURN NULL;
END $$;
CREATE TRIGGER run_measure_update AFTER UPDATE ON {RUN_TABLE} FOR EACH ROW
    WHEN (({RELEASED}) OR ({FIRST_CLAIM}) OR ({FINISHED}) OR ({SUCCEEDED}))
    EXECUTE FUNCTION scheduler_run_updated();

CREATE FUNCTION scheduler_attempt_ended() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
{DECLARE}
BEGIN
    v_bucket := 'outcome="' || NEW.state || '"';{_add(ATTEMPTS, "v_bucket", total="0")}
    RETURN NULL;
END $$;
CREATE TRIGGER attempt_measure_finish AFTER UPDATE OF state ON {ATTEMPT_TABLE} FOR EACH ROW
    WHEN ({ATTEMPT_COUNTED})
    EXECUTE FUNCTION scheduler_attempt_ended();
""",
    drop=f"""
DROP TRIGGER attempt_measure_finish ON {ATTEMPT_TABLE};
DROP TRIGGER run_measure_update ON {RUN_TABLE};
DROP TRIGGER run_measure_insert ON {RUN_TABLE};
DROP FUNCTION scheduler_attempt_ended();
DROP FUNCTION scheduler_run_updated();
DROP FUNCTION scheduler_runs_inserted();
DELETE FROM {TALLY_TABLE}
 WHERE name IN ('{DISCOVERY_LAG}', '{PUBLISH_LAG}', '{QUEUE_WAIT}', '{RUN_DURATION}',
                '{ATTEMPTS}');
DELETE FROM {DELTA_TABLE}
 WHERE name IN ('{DISCOVERY_LAG}', '{PUBLISH_LAG}', '{QUEUE_WAIT}', '{RUN_DURATION}',
                '{ATTEMPTS}');
""",
)


# -- the dead letters --------------------------------------------------------------------

RUN_FAILED = "OLD.state <> 'failed' AND NEW.state = 'failed'"  # runs are never inserted failed

# Counted as each run ends failed, not as the failed runs present: a replay (failed ->
# queued) or retention's delete would lower that count, which Prometheus takes for a
# counter reset. Started, under a lock that holds off every run's change, from the failed
# runs there and those retention had deleted (the tally that counted them goes); the drop
# puts that tally back, so the way down reads the same figure.
DEAD_LETTER_TALLY = Ddl(
    create=f"""
LOCK TABLE {RUN_TABLE} IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO {TALLY_TABLE} (name, labels, shard, count, total)
SELECT '{DEAD_LETTERS}', '', 0,
       (SELECT count(*) FROM {RUN_TABLE} WHERE state = 'failed')
       + (SELECT COALESCE(sum(count), 0) FROM {TALLY_TABLE}
           WHERE name = '{DEAD_LETTERS_PRUNED}'), 0;
DELETE FROM {TALLY_TABLE} WHERE name = '{DEAD_LETTERS_PRUNED}';

CREATE FUNCTION scheduler_run_failed() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
{DECLARE}
BEGIN{_add(DEAD_LETTERS, "''", total="0")}
    RETURN NULL;
END $$;
CREATE TRIGGER run_failed_dead_letter AFTER UPDATE OF state ON {RUN_TABLE} FOR EACH ROW
    WHEN ({RUN_FAILED})
    EXECUTE FUNCTION scheduler_run_failed();
""",
    drop=f"""
LOCK TABLE {RUN_TABLE} IN SHARE ROW EXCLUSIVE MODE;
DROP TRIGGER run_failed_dead_letter ON {RUN_TABLE};
DROP FUNCTION scheduler_run_failed();
INSERT INTO {TALLY_TABLE} (name, labels, shard, count, total)
SELECT '{DEAD_LETTERS_PRUNED}', '', 0,
       GREATEST((SELECT COALESCE(sum(count), 0) FROM {TALLY_TABLE} WHERE name = '{DEAD_LETTERS}')
                + (SELECT COALESCE(sum(count), 0) FROM {DELTA_TABLE}
                    WHERE name = '{DEAD_LETTERS}')
                - (SELECT count(*) FROM {RUN_TABLE} WHERE state = 'failed'), 0), 0;
DELETE FROM {TALLY_TABLE} WHERE name = '{DEAD_LETTERS}';
DELETE FROM {DELTA_TABLE} WHERE name = '{DEAD_LETTERS}';
""",
)


# -- the runs by state and the outbox backlog --------------------------------------------


def _add_deltas(name: str, labels: str, deltas: str) -> str:
    """SQL: append the signed `deltas` (rows of `state`, `delta`) to tally `name`, one row
    per label whose net change is not zero (an update that left the state alone writes
    nothing)."""
    return f"""
    INSERT INTO {DELTA_TABLE} (name, labels, count, total)
    SELECT '{name}', {labels}, sum(delta), 0
      FROM ({deltas}) AS deltas GROUP BY 2 HAVING sum(delta) <> 0;"""


RUN_LABEL = "'state=\"' || state || '\"'"
# Net change by state without joining old and new rows: the rows of a state after the
# statement minus those before (a row whose state did not change cancels out).
_RUN_DELTAS = {
    "insert": "SELECT state, 1 AS delta FROM new_rows",
    "update": "SELECT state, 1 AS delta FROM new_rows UNION ALL SELECT state, -1 FROM old_rows",
    "delete": "SELECT state, -1 AS delta FROM old_rows",
}
_OUTBOX_DELTAS = {
    event: deltas.replace("FROM new_rows", "FROM new_rows WHERE state = 'pending'").replace(
        "FROM old_rows", "FROM old_rows WHERE state = 'pending'"
    )
    for event, deltas in _RUN_DELTAS.items()
}
_REFERENCING = {
    "insert": "NEW TABLE AS new_rows",
    "update": "OLD TABLE AS old_rows NEW TABLE AS new_rows",
    "delete": "OLD TABLE AS old_rows",
}
_EVENTS = ("insert", "update", "delete")
# (function/trigger name, table, tally, label, deltas by event)
_STATE_TALLIES = (
    ("run_state_tally", RUN_TABLE, RUNS_BY_STATE, RUN_LABEL, _RUN_DELTAS),
    ("outbox_backlog_tally", OUTBOX_TABLE, OUTBOX_BACKLOG, "''", _OUTBOX_DELTAS),
)
# (trigger and function name, table) of every state tally trigger.
STATE_TALLY_TRIGGERS = tuple(
    (f"{name}_{event}", table) for name, table, *_ in _STATE_TALLIES for event in _EVENTS
)


def _state_tally_triggers() -> str:
    statements = []
    for name, table, tally, labels, deltas in _STATE_TALLIES:
        for event in _EVENTS:
            statements += [
                f"""CREATE FUNCTION {name}_{event}() RETURNS trigger LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN{_add_deltas(tally, labels, deltas[event])}
    RETURN NULL;
END $$;""",
                # PostgreSQL allows transition tables on one event per trigger only.
                f"CREATE TRIGGER {name}_{event} AFTER {event.upper()} ON {table}"
                f" REFERENCING {_REFERENCING[event]} FOR EACH STATEMENT"
                f" EXECUTE FUNCTION {name}_{event}();",
            ]
    return "\n".join(statements)


# Statement-level triggers with transition tables: a statement that inserts, moves or
# deletes thousands of rows (the materializer's batch, the relay's delete, the worker's
# packed successes, retention) appends one delta row per state it changed, not one write
# per row. The count and the triggers in one transaction (a migration's),
# with every write to both tables held off meanwhile (reads go on): no row is counted twice
# or missed between them.
STATE_TALLIES = Ddl(
    create=f"""
LOCK TABLE {RUN_TABLE}, {OUTBOX_TABLE} IN SHARE ROW EXCLUSIVE MODE;
DELETE FROM {TALLY_TABLE} WHERE name IN ('{RUNS_BY_STATE}', '{OUTBOX_BACKLOG}');
DELETE FROM {DELTA_TABLE} WHERE name IN ('{RUNS_BY_STATE}', '{OUTBOX_BACKLOG}');
INSERT INTO {TALLY_TABLE} (name, labels, shard, count, total)
SELECT '{RUNS_BY_STATE}', {RUN_LABEL}, 0, count(*), 0 FROM {RUN_TABLE} GROUP BY state;
INSERT INTO {TALLY_TABLE} (name, labels, shard, count, total)
SELECT '{OUTBOX_BACKLOG}', '', 0, count(*), 0 FROM {OUTBOX_TABLE} WHERE state = 'pending';
{_state_tally_triggers()}
""",
    drop="\n".join(
        f"DROP TRIGGER {name} ON {table}; DROP FUNCTION {name}();"
        for name, table in STATE_TALLY_TRIGGERS
    )
    + f"\nDELETE FROM {TALLY_TABLE} WHERE name IN ('{RUNS_BY_STATE}', '{OUTBOX_BACKLOG}');"
    + f"\nDELETE FROM {DELTA_TABLE} WHERE name IN ('{RUNS_BY_STATE}', '{OUTBOX_BACKLOG}');",
)


# -- the roll-up ---------------------------------------------------------------------------


def tallies_roll_up(*, limit: int) -> int:
    """Add up to `limit` committed deltas into their series' rolled-up rows and delete
    them, in one statement (a reader's snapshot sees them in one place or the other, never
    both or neither); the number of deltas rolled up. Runs in the caller's transaction.
    Locks: the deltas it takes, with SKIP LOCKED (two roll-ups take disjoint deltas; the
    triggers only insert, so nothing else waits), and the rolled-up rows it adds to, in
    (name, labels) order: concurrent roll-ups wait for each other there, never deadlock."""
    return int(
        fetch_value(
            f"""
        WITH taken AS (
            SELECT id FROM {DELTA_TABLE} LIMIT %s FOR UPDATE SKIP LOCKED
        ), moved AS (
            DELETE FROM {DELTA_TABLE} d USING taken WHERE d.id = taken.id
            RETURNING d.name, d.labels, d.count, d.total
        ), summed AS (
            SELECT name, labels, sum(count)::bigint AS count, sum(total) AS total,
                   count(*) AS deltas
              FROM moved GROUP BY name, labels
        ), added AS (
            INSERT INTO {TALLY_TABLE} AS t (name, labels, shard, count, total)
            SELECT name, labels, 0, count, total FROM summed ORDER BY name, labels
            ON CONFLICT (name, labels, shard) DO UPDATE
               SET count = t.count + excluded.count, total = t.total + excluded.total
        )
        SELECT coalesce(sum(deltas), 0)::bigint FROM summed""",
            [limit],
        )
    )
