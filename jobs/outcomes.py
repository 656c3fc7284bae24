"""The outcome service: how the end of an attempt is recorded, whoever saw it end.

The worker records its handler's success or failure, the reaper an attempt whose lease
expired or that overran its deadline, reconciliation a run left `running` without a live
attempt. Each goes through the services here, in batches: a success or failure is written
only while its attempt holds its run's current fencing token (a refused one changes
nothing), and a run whose attempt did not succeed is retried or failed by
`jobs.retry.retry_decision`, the one place that decides it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence

from django.db import transaction
from django.db.models import Q

from .audit import audit_record
from .counters import counter_increment
from .models import Attempt, AttemptState, Job, Run, RunState
from .notify import CHANNEL_SCHEDULE, notify
from .retry import retry_decision
from .services import job_pause_if_failing
from .transitions import attempt_fail, attempts_succeed, run_end_orphan


@dataclasses.dataclass(frozen=True)
class Success:
    """A handler's success: its attempt (as claimed or reserved) and its storable result."""

    attempt: Attempt
    result: object


def attempts_record_success(*, successes: list[Success], manifests: Sequence = ()) -> set[int]:
    """Attempts and their runs succeeded, with their results, in one statement
    (`jobs.transitions.attempts_succeed`); each only while it holds its run's current token.
    The ids of the attempts that won; the others were stale and changed nothing. Runs in the
    caller's transaction, which the worker also seals the runs' logs in (`manifests`: in
    the same statement, when they are all there is to write: logs_app.store)."""
    return attempts_succeed(
        outcomes=[(success.attempt, success.result) for success in successes], manifests=manifests
    )


@dataclasses.dataclass(frozen=True)
class Failure:
    """An attempt that did not succeed. `ended`: AttemptState.FAILED (its handler raised),
    TIMED_OUT or LOST; `spec` and `retry_base` are its run's, for the retry decision;
    `retryable` False for NonRetryableError."""

    attempt: Attempt
    spec: dict
    retry_base: int
    ended: str
    error: str
    retryable: bool = True


def attempts_record_failure(
    *, failures: list[Failure], now: dt.datetime, by: str, only_if: Q | None = None
) -> dict[int, str | None]:
    """End running attempts that did not succeed, and retry or fail their runs, in one
    transaction (the caller's, when it has one: no savepoint, a refused outcome writes
    nothing). Per attempt id: its run's new state, or None when the attempt no longer held
    the current token (or no longer matched `only_if`). `by` names the component, for the
    run's history. A run that failed may pause its job (`pause_after_failures`), after the
    commit."""
    with transaction.atomic(savepoint=False):
        return {
            failure.attempt.id: _record_failure(failure, now=now, by=by, only_if=only_if)
            for failure in failures
        }


def attempt_record_failure(
    *,
    attempt: Attempt,
    spec: dict,
    retry_base: int,
    ended: str,
    error: str,
    now: dt.datetime,
    by: str,
    retryable: bool = True,
    only_if: Q | None = None,
) -> str | None:
    """The one-attempt form of `attempts_record_failure`: the run's new state, or None."""
    failure = Failure(attempt=attempt, spec=spec, retry_base=retry_base, ended=ended,
                      error=error, retryable=retryable)  # fmt: skip
    return attempts_record_failure(failures=[failure], now=now, by=by, only_if=only_if)[attempt.id]


def _record_failure(
    failure: Failure, *, now: dt.datetime, by: str, only_if: Q | None
) -> str | None:
    attempt, ended = failure.attempt, failure.ended
    decision = retry_decision(spec=failure.spec, attempt_number=attempt.number,
                              retry_base=failure.retry_base, ended=ended,
                              retryable=failure.retryable, now=now)  # fmt: skip
    won = attempt_fail(
        attempt=attempt,
        now=now,
        error=failure.error,
        retry_at=decision.retry_at,
        reason=decision.failure_reason,
        attempt_to=ended,
        only_if=only_if,
    )
    if not won:
        return None
    if ended != AttemptState.FAILED:
        # A lost or timed-out attempt is not the handler's own report: keep it visible.
        retry_at = decision.retry_at
        audit_record(action=f"attempt.{ended}", by=by, run_id=attempt.run_id,
                     data={"attempt": attempt.number, "fencing_token": attempt.fencing_token,
                           "retry_at": retry_at.isoformat() if retry_at else None,
                           "failure_reason": decision.failure_reason})  # fmt: skip
    if ended == AttemptState.LOST:
        counter_increment("scheduler_lease_expired_total")
    if decision.retry_at is not None:
        # The promoter queues the retry at its instant.
        notify(CHANNEL_SCHEDULE, at=decision.retry_at)
        return RunState.RETRY_WAIT
    # After the commit, in its own transaction: pausing locks the job row, and doing it
    # here (attempt and run locked) would invert the scheduler's job-then-run order.
    transaction.on_commit(lambda: _pause_job_of_run_if_failing(attempt.run_id, now))
    return RunState.FAILED


def runs_record_orphaned(*, runs: list[Run], now: dt.datetime) -> dict:
    """Runs `running` without a running attempt that holds their token (only a bug or a
    hand edit makes one; reconciliation finds them), ended as a lost attempt would end
    them: retried or failed by the job's policy, each only while its token is unchanged.
    `runs` come with their `job_version`, locked by the caller. Per run id that moved: its
    new state."""
    moved = {}
    for run in runs:
        decision = retry_decision(
            spec=run.job_version.spec,
            attempt_number=run.attempt_count,
            retry_base=run.retry_base,
            ended=AttemptState.LOST,
            now=now,
        )
        retry_at = decision.retry_at
        if run_end_orphan(run_id=run.id, token=run.fencing_token, now=now, retry_at=retry_at,
                          reason=decision.failure_reason):  # fmt: skip
            moved[run.id] = RunState.RETRY_WAIT if retry_at else RunState.FAILED
    return moved


def _pause_job_of_run_if_failing(run_id, now: dt.datetime) -> None:
    job = Job.objects.filter(runs__id=run_id).first()
    if job is not None and job.spec.get("pause_after_failures"):
        job_pause_if_failing(job=job, now=now)
