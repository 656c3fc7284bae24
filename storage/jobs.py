"""Jobs: the batched advance of their next occurrence."""

from __future__ import annotations

import datetime as dt
import uuid

from .sql import execute

_ADVANCE = """
    UPDATE jobs_job AS job
       SET next_run_at = advanced.next_run_at
      FROM unnest(%s::uuid[], %s::timestamptz[]) AS advanced (id, next_run_at)
     WHERE job.id = advanced.id
"""


def jobs_advance(*, job_ids: list[uuid.UUID], next_run_ats: list[dt.datetime | None]) -> int:
    """Store each job's next occurrence (`next_run_ats[i]` for `job_ids[i]`, None: none), in
    one statement joined to the new values unnested from two arrays. The number of jobs
    updated. Runs in the caller's transaction, which holds the jobs' row locks (FOR UPDATE:
    no other writer interleaves); takes them itself otherwise."""
    if not job_ids:
        return 0
    return execute(_ADVANCE, [list(job_ids), list(next_run_ats)])
