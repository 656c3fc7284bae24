"""Reads on jobs that the ORM cannot express as one bounded statement."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import NamedTuple

from .sql import fetch_all

# Per job, its latest `limit` finished runs since its last resume, newest first: a backward
# walk of run_job_finished_idx that stops after `limit` rows, whatever the job's history.
LATEST_FINISHED = """
SELECT limits.job_id, latest.state
  FROM unnest(%(jobs)s::uuid[], %(limits)s::int[]) AS limits(job_id, n)
  JOIN jobs_job j ON j.id = limits.job_id
 CROSS JOIN LATERAL (
       SELECT r.state FROM jobs_run r
        WHERE r.job_id = limits.job_id AND r.state IN ('failed', 'succeeded')
          AND r.finished_at IS NOT NULL
          AND (j.resumed_at IS NULL OR r.finished_at > j.resumed_at)
        ORDER BY r.finished_at DESC, r.id DESC
        LIMIT limits.n) AS latest"""


class FinishedRun(NamedTuple):
    job_id: uuid.UUID
    state: str  # 'failed' or 'succeeded'


def jobs_latest_finished_runs(*, limits: Mapping[uuid.UUID, int]) -> list[FinishedRun]:
    """For each job of `limits` (job id -> n), the states of its latest n finished runs
    (failed or succeeded; skipped and cancelled ones do not count) since its last resume:
    one statement for the whole batch, each job's a bounded walk of run_job_finished_idx.
    Reads in the caller's transaction; takes no lock."""
    if not limits:
        return []
    rows = fetch_all(LATEST_FINISHED, {"jobs": list(limits), "limits": list(limits.values())})
    return [FinishedRun(job_id, state) for job_id, state in rows]
