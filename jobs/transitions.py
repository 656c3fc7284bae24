"""Every state transition of jobs, runs and attempts: one conditional UPDATE each.

Each function returns whether it won. A transition whose row is no longer in a state it may
leave, or whose fencing token is no longer current, changes nothing and returns False.
The bookkeeping fields of a run that other components count on (published, republished,
duplicate deliveries) are written here too, each by one conditional UPDATE.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable

from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from .models import Attempt, AttemptState, FailureReason, Job, JobState, Run, RunState

# -- jobs -------------------------------------------------------------------------------
# to-state -> the states a job may enter it from.
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    JobState.PAUSED: frozenset({JobState.ACTIVE}),
    JobState.ACTIVE: frozenset({JobState.PAUSED}),
    JobState.CANCELLED: frozenset({JobState.ACTIVE, JobState.PAUSED}),
    # A job whose schedule is over, once none of its runs is active (the completer).
    JobState.COMPLETED: frozenset({JobState.ACTIVE}),
}
# Job states in which its spec may change and operators may act on it.
LIVE_JOB_STATES = (JobState.ACTIVE, JobState.PAUSED)


def _move_jobs(job_ids: Iterable, to: str, *, only_if: Q | None = None, **fields) -> int:
    """Move the jobs that may enter `to` (and match `only_if`); a deleted job never moves,
    except to cancelled (a delete cancels its job first)."""
    rows = Job.objects.filter(id__in=list(job_ids), state__in=JOB_TRANSITIONS[to])
    if to != JobState.CANCELLED:
        rows = rows.filter(deleted_at=None)
    if only_if is not None:
        rows = rows.filter(only_if)
    return rows.update(state=to, **fields)


def job_to_paused(*, job_id, now: dt.datetime) -> bool:
    """active -> paused: no new occurrence is materialized; runs already created go on."""
    return bool(_move_jobs([job_id], JobState.PAUSED, updated_at=now))


def job_to_active(*, job_id, now: dt.datetime, only_if: Q | None = None, **fields) -> bool:
    """paused -> active (a resume), with the fields it recomputed, only while `only_if`."""
    moved = _move_jobs(
        [job_id], JobState.ACTIVE, only_if=only_if, updated_at=now, resumed_at=now, **fields
    )
    return bool(moved)


def job_to_cancelled(*, job_id, now: dt.datetime) -> bool:
    """active/paused -> cancelled, for good: no more occurrences."""
    return bool(_move_jobs([job_id], JobState.CANCELLED, next_run_at=None, updated_at=now))


def jobs_to_completed(*, job_ids: list, now: dt.datetime) -> int:
    """active -> completed, for jobs whose schedule is over (the caller checked that none
    of their runs is active, under the jobs' row locks)."""
    return _move_jobs(job_ids, JobState.COMPLETED, updated_at=now)


def job_replace_spec(*, job_id, expected_version: int, fields: dict) -> bool:
    """A live job's new spec and version, by compare-and-set on the version it was based on:
    of two concurrent edits of one version, one wins."""
    return bool(
        Job.objects.filter(
            id=job_id, version=expected_version, state__in=LIVE_JOB_STATES, deleted_at=None
        ).update(**fields)
    )


def jobs_advance(*, jobs: list[Job]) -> None:
    """Store the advanced next_run_at of jobs whose due occurrences were just materialized;
    the caller holds their row locks (FOR UPDATE), so no other writer can interleave."""
    Job.objects.bulk_update(jobs, ["next_run_at"])


def job_mark_deleted(*, job_id, now: dt.datetime) -> bool:
    """Soft delete: hidden from every read from now on; versions, runs and audit stay."""
    return bool(Job.objects.filter(id=job_id, deleted_at=None).update(deleted_at=now))


# -- runs -------------------------------------------------------------------------------
ACTIVE_RUN_STATES = frozenset(
    {RunState.PENDING, RunState.QUEUED, RunState.RUNNING, RunState.RETRY_WAIT}
)
# Only an operator replay leaves these; every other terminal state is final.
REPLAYABLE_RUN_STATES = frozenset({RunState.FAILED, RunState.CANCELLED})
TERMINAL_RUN_STATES = frozenset(RunState.values) - ACTIVE_RUN_STATES

# to-state -> the states a run may enter it from. Replay (failed/cancelled -> queued) is
# the one transition not listed: only `run_replay` makes it.
RUN_TRANSITIONS: dict[str, frozenset[str]] = {
    RunState.QUEUED: frozenset({RunState.PENDING, RunState.RETRY_WAIT}),
    RunState.RUNNING: frozenset({RunState.QUEUED}),
    RunState.SUCCEEDED: frozenset({RunState.RUNNING}),
    RunState.RETRY_WAIT: frozenset({RunState.RUNNING}),
    # From queued: reconciliation gives up on a run that no worker ever claims.
    RunState.FAILED: frozenset({RunState.RUNNING, RunState.QUEUED}),
    RunState.CANCELLED: ACTIVE_RUN_STATES,
    RunState.SKIPPED: frozenset({RunState.PENDING}),
}


def _move_runs(
    run_ids: Iterable,
    to: str,
    *,
    token: int | None = None,
    from_states: Iterable[str] | None = None,
    **fields,
) -> int:
    """Move the runs that may enter `to` (or are in `from_states`, a subset of those);
    with `token`, only while it is still current."""
    allowed = RUN_TRANSITIONS[to]
    if from_states is not None:
        allowed &= frozenset(from_states)
    rows = Run.objects.filter(id__in=list(run_ids), state__in=allowed)
    if token is not None:
        rows = rows.filter(fencing_token=token)
    return rows.update(state=to, updated_at=Now(), **fields)


def runs_requeue(*, run_ids: list) -> int:
    """retry_wait/pending -> queued (the caller writes the outbox rows in the same transaction)."""
    return _move_runs(run_ids, RunState.QUEUED, next_attempt_at=None, republish_count=0)


def run_replay(*, run_id) -> bool:
    """failed/cancelled -> queued, with a fresh retry budget; the next claim issues the next
    fencing token, and the idempotency key stays. The caller writes the outbox row."""
    return bool(
        Run.objects.filter(id=run_id, state__in=REPLAYABLE_RUN_STATES).update(
            state=RunState.QUEUED,
            updated_at=Now(),
            retry_base=F("attempt_count"),
            republish_count=0,
            failure_reason="",
            finished_at=None,
            next_attempt_at=None,
            result=None,
        )
    )


def run_cancel(*, run_id, now: dt.datetime) -> bool:
    """Any active state -> cancelled; a running attempt ends `cancelled` in the same
    transaction, so its later heartbeat, effect or completion is refused."""
    with transaction.atomic():
        # Attempt before run, the order every completion (`_finish`) locks them in: the
        # opposite order deadlocks against a worker or the reaper ending the same attempt.
        list(
            Attempt.objects.select_for_update()
            .filter(run_id=run_id, state=AttemptState.RUNNING)
            .values_list("id", flat=True)
        )
        cancelled = _move_runs([run_id], RunState.CANCELLED, finished_at=now, next_attempt_at=None)
        if cancelled:
            # A fresh look, not just `running`: a claim that committed while this update
            # waited on the run row has made an attempt the first look could not see.
            Attempt.objects.filter(run_id=run_id, state=AttemptState.RUNNING).update(
                state=AttemptState.CANCELLED, finished_at=now, error="cancelled by request"
            )
        return bool(cancelled)


def run_end_orphan(
    *, run_id, token: int, now: dt.datetime, retry_at: dt.datetime | None, reason: str
) -> bool:
    """running -> retry_wait (or failed) for a run left without a live attempt, while
    `token` is still its current fencing token."""
    if retry_at is not None:
        return bool(
            _move_runs([run_id], RunState.RETRY_WAIT, token=token, next_attempt_at=retry_at)
        )
    return bool(
        _move_runs([run_id], RunState.FAILED, token=token, finished_at=now, failure_reason=reason)
    )


def run_give_up(*, run_id, now: dt.datetime, reason: str) -> bool:
    """queued -> failed: reconciliation stops re-publishing a run no worker ever claims."""
    return bool(
        _move_runs(
            [run_id],
            RunState.FAILED,
            from_states=[RunState.QUEUED],
            finished_at=now,
            failure_reason=reason,
        )
    )


def run_count_republish(*, run_id, now: dt.datetime) -> bool:
    """A queued run published again by reconciliation: counted, while it is still queued.
    `updated_at` is stamped, so that the next republication's wait counts from this one."""
    return bool(
        Run.objects.filter(id=run_id, state=RunState.QUEUED).update(
            republish_count=F("republish_count") + 1, updated_at=now
        )
    )


def run_count_duplicate_delivery(*, run_id) -> bool:
    """A delivery refused because the run was already claimed or finished: counted on it."""
    return bool(
        Run.objects.filter(id=run_id).update(duplicate_deliveries=F("duplicate_deliveries") + 1)
    )


# -- attempts ---------------------------------------------------------------------------
def run_claim(
    *,
    run_id,
    worker: str,
    now: dt.datetime,
    lease_seconds: float,
    timeout_seconds: float | None = None,
    claim_id: uuid.UUID | None = None,
    published_at: dt.datetime | None = None,
) -> Attempt | None:
    """queued -> running, with a new attempt holding the next fencing token and a lease.
    `published_at`, the delivered message's publication, is kept from the first claim.

    None when the run is not queued: a duplicate delivery of a run already claimed or
    finished, which the caller refuses and counts.
    """
    # One compare-and-set that also issues the token: UPDATE ... RETURNING (PostgreSQL and
    # SQLite >= 3.35 both have it; the ORM's update() does not return rows).
    claim = f"""
        UPDATE {Run._meta.db_table}
           SET state = %s, fencing_token = fencing_token + 1, attempt_count = attempt_count + 1,
               updated_at = %s,
               started_at = COALESCE(started_at, %s), next_attempt_at = NULL,
               published_at = COALESCE(published_at, %s)
         WHERE id = %s AND state IN ({", ".join(["%s"] * len(RUN_TRANSITIONS[RunState.RUNNING]))})
     RETURNING fencing_token, attempt_count
    """
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                claim,
                [
                    RunState.RUNNING,
                    now,
                    now,
                    published_at,
                    Run._meta.pk.get_db_prep_value(run_id, connection),
                    *sorted(RUN_TRANSITIONS[RunState.RUNNING]),
                ],
            )
            row = cursor.fetchone()
        if row is None:
            return None
        token, number = row
        return Attempt.objects.create(
            run_id=run_id,
            number=number,
            fencing_token=token,
            state=AttemptState.RUNNING,
            worker=worker[:200],
            claim_id=claim_id,
            lease_expires_at=now + dt.timedelta(seconds=lease_seconds),
            deadline_at=now + dt.timedelta(seconds=timeout_seconds) if timeout_seconds else None,
            heartbeat_at=now,
            started_at=now,
        )


def attempt_renew_lease(*, attempt: Attempt, now: dt.datetime, lease_seconds: float) -> bool:
    """Extend the lease of a running attempt that still holds the current token."""
    # Conditioned on the attempt row alone: every path that moves a run out of `running`
    # ends its running attempt in the same transaction, and a condition through a join is
    # not re-checked by PostgreSQL after waiting on the row (READ COMMITTED), so it could
    # renew an attempt the reaper ended meanwhile.
    return bool(
        Attempt.objects.filter(
            id=attempt.id, state=AttemptState.RUNNING, fencing_token=attempt.fencing_token
        ).update(heartbeat_at=now, lease_expires_at=now + dt.timedelta(seconds=lease_seconds))
    )


def attempt_abandon(*, attempt: Attempt, now: dt.datetime, error: str) -> bool:
    """running -> lost for an attempt whose run no longer carries its token (only a bug or
    a hand edit makes one); the run is left as it is."""
    return bool(
        Attempt.objects.filter(
            id=attempt.id, state=AttemptState.RUNNING, fencing_token=attempt.fencing_token
        )
        .exclude(run__fencing_token=attempt.fencing_token, run__state=RunState.RUNNING)
        .update(state=AttemptState.LOST, finished_at=now, error=error)
    )


def _finish(
    attempt: Attempt,
    *,
    attempt_to: str,
    run_to: str,
    now: dt.datetime,
    error: str = "",
    only_if: Q | None = None,
    **run_fields,
) -> bool:
    """The attempt leaves running and its run moves to `run_to`, both or neither, and only
    while the attempt holds the run's current fencing token."""
    with transaction.atomic():
        # No join on the run here: the run's own update below is conditioned on the token,
        # and losing it rolls both back.
        rows = Attempt.objects.filter(
            id=attempt.id, state=AttemptState.RUNNING, fencing_token=attempt.fencing_token
        )
        if only_if is not None:
            rows = rows.filter(only_if)
        finished = rows.update(state=attempt_to, finished_at=now, error=error)
        if not finished:
            return False
        if not _move_runs(
            [attempt.run_id],
            run_to,
            token=attempt.fencing_token,
            from_states=[RunState.RUNNING],
            **run_fields,
        ):
            transaction.set_rollback(True)
            return False
        return True


def attempt_succeed(*, attempt: Attempt, now: dt.datetime, result=None) -> bool:
    """running -> succeeded, for the attempt and its run."""
    return _finish(
        attempt,
        attempt_to=AttemptState.SUCCEEDED,
        run_to=RunState.SUCCEEDED,
        now=now,
        finished_at=now,
        result=result,
        failure_reason="",
    )


def attempt_fail(
    *,
    attempt: Attempt,
    now: dt.datetime,
    error: str,
    retry_at: dt.datetime | None,
    reason: str = FailureReason.EXHAUSTED,
    attempt_to: str = AttemptState.FAILED,
    only_if: Q | None = None,
) -> bool:
    """running -> failed (or timed_out, lost, per `attempt_to`) for the attempt; the run
    waits for a retry at `retry_at`, or fails with `reason`."""
    if retry_at is not None:
        return _finish(
            attempt,
            attempt_to=attempt_to,
            run_to=RunState.RETRY_WAIT,
            now=now,
            only_if=only_if,
            error=error,
            next_attempt_at=retry_at,
        )
    return _finish(
        attempt,
        attempt_to=attempt_to,
        run_to=RunState.FAILED,
        now=now,
        only_if=only_if,
        error=error,
        finished_at=now,
        failure_reason=reason,
    )
