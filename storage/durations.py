"""What each task's recent runs took: the figures the relay packs a task's runs by
(dispatch.packing). Read, never written: the run rows keep `started_at` and `finished_at`
already, so nothing is added to the completion path.

The read is bounded: the last WINDOW finished runs, newest first through run_finished_idx,
grouped by task. A task none of whose runs are among them reads as having no history.
"""

from __future__ import annotations

from typing import NamedTuple

from .sql import fetch_all

WINDOW = 2000  # finished runs read, newest first


class TaskDurations(NamedTuple):
    count: int  # finished runs seen
    mean: float  # seconds
    p90: float  # seconds


def task_durations_recent(*, window: int = WINDOW) -> dict[str, TaskDurations]:
    """For each task with runs among the last `window` finished (succeeded or failed,
    started), how many, and their mean and 90th percentile of started -> finished."""
    rows = fetch_all(
        """
        SELECT j.task, count(*), avg(r.seconds),
               percentile_cont(0.9) WITHIN GROUP (ORDER BY r.seconds)
          FROM (SELECT job_id,
                       GREATEST(EXTRACT(EPOCH FROM finished_at - started_at)::float8, 0)
                           AS seconds
                  FROM jobs_run
                 WHERE state IN ('cancelled', 'failed', 'skipped', 'succeeded')
                   AND finished_at IS NOT NULL AND started_at IS NOT NULL
                 ORDER BY finished_at DESC
                 LIMIT %(window)s) AS r
          JOIN jobs_job AS j ON j.id = r.job_id
         GROUP BY j.task
        """,
        {"window": window},
    )
    return {task: TaskDurations(count, mean, p90) for task, count, mean, p90 in rows}
