"""A job's schedule policies as pure decisions (docs/api.md, "Schedule policies").

Misfire (which late occurrences run), overlap (what a new run does while others of its job
are active) and jitter (how long a run's publication is held back). Nothing here touches
the database: the materializer (dispatch.materializer) reads the rows, asks these
functions, and applies what they decide.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
from collections.abc import Sequence
from typing import Literal

from .models import Run, RunState

# An occurrence later than this (when misfire.grace_seconds is null) is a misfire.
MISFIRE_DEFAULT_GRACE = dt.timedelta(seconds=60)
# The least grace applied: a pass takes milliseconds, so a grace of 0 would skip an
# occurrence reached on time.
MISFIRE_MIN_GRACE = dt.timedelta(seconds=1)
# Run states that hold a buffer_one job's pending run back.
BUSY_RUN_STATES = (RunState.QUEUED, RunState.RUNNING, RunState.RETRY_WAIT)


def run_jitter(idempotency_key: str, jitter_seconds: int) -> dt.timedelta:
    """A run's publication delay in [0, jitter_seconds], a function of its identity only,
    so every replica and every retry computes the same one."""
    if not jitter_seconds:
        return dt.timedelta(0)
    digest = int.from_bytes(hashlib.sha256(idempotency_key.encode()).digest()[:8], "big")
    return dt.timedelta(seconds=digest % (jitter_seconds + 1))


def misfire_plan(
    *,
    spec: dict,
    created_at: dt.datetime,
    due: list[dt.datetime],
    next_at: dt.datetime | None,
    now: dt.datetime,
) -> dict[dt.datetime, str]:
    """Occurrence -> skip reason, for the due occurrences the misfire policy does not run.

    An occurrence is missed when it is later than the grace, counted from the occurrence or
    from the job's creation, whichever is later (a new one-time job whose run_at has passed
    fires as a catch-up). `next_at` is the job's next occurrence after `due`.
    """
    misfire = spec.get("misfire") or {}
    grace_seconds = misfire.get("grace_seconds")
    grace = MISFIRE_DEFAULT_GRACE if grace_seconds is None else dt.timedelta(seconds=grace_seconds)
    grace = max(grace, MISFIRE_MIN_GRACE)

    def late(at: dt.datetime) -> bool:
        return now - max(at, created_at) > grace

    missed = [at for at in due if late(at)]
    policy = misfire.get("policy", "run_all")
    if not missed or policy == "run_all":
        return {}
    if policy == "skip":
        return {
            at: f"misfire: missed by {int((now - at).total_seconds())}s (policy skip)"
            for at in missed
        }
    # run_latest: the latest missed occurrence runs, unless a later due one (in this pass,
    # or waiting beyond this pass's cap) supersedes it.
    superseded = missed
    if len(missed) == len(due) and (next_at is None or next_at > now):
        superseded = missed[:-1]
    return {
        at: "misfire: superseded by a later occurrence (policy run_latest)" for at in superseded
    }


@dataclasses.dataclass(frozen=True)
class OverlapDecision:
    """What a new run does: `go` (as it is), `pending` (held back until its job is free),
    or `skip` (recorded skipped with `skip_reason`). `cancel`: the active runs to cancel
    first (cancel_previous), each with `cancel_reason`."""

    outcome: Literal["go", "pending", "skip"] = "go"
    skip_reason: str = ""
    cancel: tuple[Run, ...] = ()
    cancel_reason: str = ""


def overlap_decision(
    *, policy: str, active: Sequence[Run], scheduled_for: dt.datetime
) -> OverlapDecision:
    """The overlap policy's answer for a new run of `scheduled_for` while `active` (its
    job's active scheduled runs, oldest first) are not finished."""
    if not active or policy == "allow":
        return OverlapDecision()
    previous = active[-1]
    if policy == "skip":
        return OverlapDecision(
            outcome="skip",
            skip_reason=f"overlap: run {previous.id} is still {previous.state} (policy skip)",
        )
    if policy == "buffer_one":
        if any(other.state == RunState.PENDING for other in active):
            return OverlapDecision(
                outcome="skip", skip_reason="overlap: a run is already buffered (policy buffer_one)"
            )
        return OverlapDecision(outcome="pending")
    # cancel_previous: cancel what runs, then go ahead.
    return OverlapDecision(
        cancel=tuple(active),
        cancel_reason=f"overlap: superseded by the occurrence at {scheduled_for.isoformat()}",
    )
