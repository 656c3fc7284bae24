"""Identity keys of runs: what handlers give external systems to deduplicate their effects.

A run's `idempotency_key` is stable across all its attempts, and a function of the run's
identity only, so every scheduler replica computes the same one for the same occurrence.
"""

from __future__ import annotations

import datetime as dt
import uuid


def _instant(at: dt.datetime) -> str:
    return f"{at.astimezone(dt.UTC):%Y%m%dT%H%M%S.%fZ}"


def occurrence_key(job_id, scheduled_for: dt.datetime) -> str:
    """A scheduled run: one per (job, occurrence)."""
    return f"{job_id}:{_instant(scheduled_for)}"


def backfill_key(job_id, scheduled_for: dt.datetime) -> str:
    """A backfill run: one per (job, occurrence), apart from the scheduled one."""
    return f"{job_id}:backfill:{_instant(scheduled_for)}"


def manual_key(job_id) -> str:
    """A manual trigger: each one is a run of its own."""
    return f"{job_id}:manual:{uuid.uuid4().hex}"


def dependent_key(job_id, kind: str, scheduled_for: dt.datetime) -> str:
    """A run created by its upstreams' ends (jobs.dependencies): one per (job, kind,
    instant), so a repeated signal makes none; scheduled and backfill runs take the keys
    their kind's occurrences have."""
    if kind == "backfill":
        return backfill_key(job_id, scheduled_for)
    if kind == "manual":
        return f"{job_id}:manual:{_instant(scheduled_for)}"
    return occurrence_key(job_id, scheduled_for)
