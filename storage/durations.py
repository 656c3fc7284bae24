"""What each task's recent runs took: the figures the relay packs a task's runs by
(dispatch.packing). Read, never written: the run and attempt rows keep their times
already, so nothing is added to the completion path.

The read is bounded: the last WINDOW finished runs, newest first through run_finished_idx,
each with its last attempt (attempt_number_unique), grouped by task. A task none of whose
runs are among them reads as having no history.

The runs that travelled in one message (their last attempts share its task id) count as
one figure each, the message's time divided among its runs: from the first run's start to
the last one's finish. A packed run's own start -> finish would count the runs after it
whose successes were recorded with its own, and make a short task look long once packed.
"""

from __future__ import annotations

from typing import NamedTuple

from .sql import fetch_all

WINDOW = 2000  # finished runs read, newest first


class TaskDurations(NamedTuple):
    count: int  # finished runs seen
    mean: float  # seconds a run
    p90: float  # seconds a run, over the messages


def task_durations_recent(*, window: int = WINDOW) -> dict[str, TaskDurations]:
    """For each task with runs among the last `window` finished (started ones), how many,
    the mean seconds a run, and the 90th percentile over their messages of the seconds a
    run of the message took."""
    rows = fetch_all(
        """
        WITH recent AS (
            SELECT id, job_id, attempt_count, started_at, finished_at
              FROM jobs_run
             WHERE state IN ('cancelled', 'failed', 'skipped', 'succeeded')
               AND finished_at IS NOT NULL AND started_at IS NOT NULL
             ORDER BY finished_at DESC
             LIMIT %(window)s
        ),
        messages AS (
            SELECT j.task, count(*) AS runs,
                   GREATEST(EXTRACT(EPOCH FROM max(r.finished_at) - min(r.started_at))::float8,
                            0) AS seconds
              FROM recent AS r
              JOIN jobs_job AS j ON j.id = r.job_id
              LEFT JOIN jobs_attempt AS a ON a.run_id = r.id AND a.number = r.attempt_count
             GROUP BY j.task, COALESCE(NULLIF(a.task_id, ''), r.id::text)
        )
        SELECT task, sum(runs)::int, sum(seconds) / sum(runs),
               percentile_cont(0.9) WITHIN GROUP (ORDER BY seconds / runs)
          FROM messages
         GROUP BY task
        """,
        {"window": window},
    )
    return {task: TaskDurations(count, mean, p90) for task, count, mean, p90 in rows}
