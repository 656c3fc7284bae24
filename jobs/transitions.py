"""Every state transition of jobs, runs and attempts: one conditional UPDATE each.

Each function returns whether it won. A transition whose row is no longer in a state it may
leave, or whose fencing token is no longer current, changes nothing and returns False.
The bookkeeping fields of a run that other components count on (published, republished,
duplicate deliveries) are written here too, each by one conditional UPDATE.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Sequence

from django.db import transaction
from django.db.models import DateTimeField, Exists, F, Q, Value
from django.db.models.functions import Coalesce, Now

import storage.attempts
import storage.runs

from .models import (
    ActiveRun,
    Attempt,
    AttemptState,
    FailureReason,
    Job,
    JobState,
    JobVersion,
    Run,
    RunState,
)

# -- jobs -------------------------------------------------------------------------------
# to-state -> the states a job may enter it from.
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    JobState.PAUSED: frozenset({JobState.ACTIVE}),
    JobState.ACTIVE: frozenset({JobState.PAUSED}),
    JobState.CANCELLED: frozenset({JobState.ACTIVE, JobState.PAUSED}),
    # A job whose schedule is over, once none of its runs is active: by the rule of
    # storage.completion, in the statement that ends its last run (trigger
    # run_ended_completes_job), else by the completer's safety net (dispatch.completer).
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


def job_replace_spec(*, job_id, expected_version: int, fields: dict) -> bool:
    """A live job's new spec and version, by compare-and-set on the version it was based on:
    of two concurrent edits of one version, one wins."""
    return bool(
        Job.objects.filter(
            id=job_id, version=expected_version, state__in=LIVE_JOB_STATES, deleted_at=None
        ).update(**fields)
    )


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


# The operators' actions (the API's endpoints and the admin's actions alike) -> the states
# their object may be in for the action to change anything, from the tables above: the
# admin offers an action's button only there (jobs/admin/actions.py).
JOB_ACTION_STATES: dict[str, frozenset[str]] = {
    "job.pause": JOB_TRANSITIONS[JobState.PAUSED],
    "job.resume": JOB_TRANSITIONS[JobState.ACTIVE],
    "job.cancel": JOB_TRANSITIONS[JobState.CANCELLED],
    "job.trigger": frozenset(LIVE_JOB_STATES),  # a manual run of a live job
    "job.backfill": frozenset(LIVE_JOB_STATES),
}
RUN_ACTION_STATES: dict[str, frozenset[str]] = {
    "run.cancel": RUN_TRANSITIONS[RunState.CANCELLED],
    "run.replay": REPLAYABLE_RUN_STATES,
}


def action_possible(*, action: str, obj: Job | Run) -> bool:
    """Whether `action` (`job.pause`, `run.replay`, ...) may change `obj` in its state as
    read (a deleted job: none); the service's conditional update still decides."""
    if isinstance(obj, Job):
        return obj.deleted_at is None and obj.state in JOB_ACTION_STATES[action]
    return obj.state in RUN_ACTION_STATES[action]


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
    fencing token, and the idempotency key stays. `replayed_at` is stamped with the
    database's now: from then on the run travels in its queue's replay lane (jobs.lanes),
    its retries and republications too. The caller writes the outbox row."""
    return bool(
        Run.objects.filter(id=run_id, state__in=REPLAYABLE_RUN_STATES).update(
            state=RunState.QUEUED,
            updated_at=Now(),
            replayed_at=Now(),
            retry_base=F("attempt_count"),
            republish_count=0,
            failure_reason="",
            finished_at=None,
            next_attempt_at=None,
            result=None,
        )
    )


# Tries of runs_lock_to_cancel before it goes on with what it holds (each one finds a run
# claimed between two of its statements, rare itself).
LOCK_TO_CANCEL_TRIES = 3


class _StartedMeanwhile(Exception):
    """A run was claimed between the lock of the running attempts and that of the runs."""


def runs_lock_to_cancel(*, run_ids: list) -> None:
    """Lock what cancelling these runs changes, in the caller's transaction, before it
    cancels them one by one (the materializer's cancel_previous over several jobs, a job's
    cancel), attempts before runs, the order every completion takes: first every running
    attempt of them, in id order (the order a packed success takes,
    storage.attempts.attempts_succeed); then those runs not running, in id order, so no
    claim starts an attempt of them meanwhile (a claim in flight is waited for).

    A claim that commits while the second statement waits locks its run all the same (PostgreSQL
    locks the row's new version before it finds it no longer matches) without its attempt:
    holding that run and then waiting for its attempt deadlocked against the worker ending
    it (attempt held, run wanted). So the runs are locked in a savepoint, and should one
    of them have a running attempt not held, the savepoint is rolled back (its run locks
    go with it) and both steps are taken again, at most LOCK_TO_CANCEL_TRIES times."""
    ids = list(run_ids)
    if not ids:
        return
    running = Attempt.objects.filter(run_id__in=ids, state=AttemptState.RUNNING)
    for _ in range(LOCK_TO_CANCEL_TRIES):
        held = set(running.select_for_update().order_by("id").values_list("id", flat=True))
        try:
            with transaction.atomic():  # a savepoint
                list(
                    Run.objects.select_for_update()
                    .filter(id__in=ids)
                    .exclude(state=RunState.RUNNING)
                    .order_by("id")
                    .values_list("id", flat=True)
                )
                if set(running.values_list("id", flat=True)) - held:
                    raise _StartedMeanwhile
            return
        except _StartedMeanwhile:
            continue


def jobs_lock_to_cancel(*, job_ids: list) -> None:
    """Lock what cancelling these jobs changes, in the caller's transaction, before it
    cancels them one by one (a bulk operation's `jobs.cancel` batch): the jobs' rows in id
    order, then every active run of them at once through runs_lock_to_cancel (attempts,
    then runs, each in id order). Job by job, a batch held the attempt of one job's run
    and wanted another job's, which a packed success of both runs held while it wanted
    the first: a deadlock. The job rows come first, as the materializer takes a job before
    its runs (it passes over a job locked here, SKIP LOCKED); once they are held no new
    run of them starts to exist (a trigger or a backfill locks its job first)."""
    ids = list(job_ids)
    if not ids:
        return
    list(
        Job.objects.select_for_update()
        .filter(id__in=ids)
        .order_by("id")
        .values_list("id", flat=True)
    )
    runs_lock_to_cancel(
        run_ids=list(
            Run.objects.filter(job_id__in=ids, state__in=ACTIVE_RUN_STATES).values_list(
                "id", flat=True
            )
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


def runs_stamp_published_late(*, run_ids: list, now: dt.datetime) -> int:
    """Queued runs whose message waited in the outbox (backpressure, an owner's limit) and
    was published only now: `updated_at` is stamped, so that reconciliation's wait and its
    evidence count from the publication, not from the queueing long before."""
    if not run_ids:
        return 0
    return Run.objects.filter(id__in=run_ids, state=RunState.QUEUED).update(updated_at=now)


def active_runs_record(*, runs: list[tuple], now: dt.datetime) -> int:
    """(run id, owner id) of runs of limited owners just published: they count against
    their owner's limit while queued or running (dispatch.shares). A run published again
    (reconciliation) is counted once."""
    if not runs:
        return 0
    rows = [
        ActiveRun(run_id=run_id, owner_id=owner_id, published_at=now) for run_id, owner_id in runs
    ]
    return len(ActiveRun.objects.bulk_create(rows, ignore_conflicts=True))


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
    now: dt.datetime | None = None,
    lease_seconds: float | None = None,
    timeout_seconds: float | None = None,
    claim_id: uuid.UUID | None = None,
    published_at: dt.datetime | None = None,
    task_id: str = "",
    gated: bool = False,
) -> Attempt | None:
    """queued -> running, with a new attempt holding the next fencing token and a lease.

    None when the run is not queued: a duplicate delivery of a run already claimed or
    finished, which the caller refuses and counts. `now` defaults to the database's clock;
    `lease_seconds` and `timeout_seconds` to the spec's heartbeat and run timeouts.
    `published_at` (from the delivered message) stamps the run's first publication;
    `task_id` is the delivering Celery task's id, kept on the attempt.

    The attempt comes with `attempt.run` (and `run.job_version.spec`) as the claim read
    them, so a worker needs nothing more before it runs the handler. The whole claim is one
    statement (`storage.runs.run_claim`): the compare-and-set that issues the token, the
    read of the spec and the attempt's insert, atomic without a transaction block of its own.
    `gated`: only when the run's queue has no control in force (None otherwise too: the
    caller then goes through dispatch.queues), its control row share-locked by the claim.
    """
    claimed = storage.runs.run_claim(
        run_id=run_id,
        worker=worker[:200],
        claim_id=claim_id,
        now=now,
        lease_seconds=lease_seconds,
        timeout_seconds=timeout_seconds,
        published_at=published_at,
        task_id=task_id[:64],
        gated=gated,
    )
    if claimed is None:
        return None
    return _claimed_attempt(claimed, worker=worker[:200], claim_id=claim_id, task_id=task_id[:64])


def _claimed_attempt(
    row: storage.runs.ClaimedRun, *, worker: str, claim_id, task_id: str, reserved=False
) -> Attempt:
    """The attempt a claim (or a reservation) made, with its run and spec, as the claim's
    statement returned them: the worker needs nothing more before it runs the handler."""
    version = JobVersion(id=row.job_version_id, job_id=row.job_id, spec=row.spec)
    run = Run(
        id=row.id, job_id=row.job_id, job_version=version, kind=row.kind,
        state=RunState.RUNNING, scheduled_for=row.scheduled_for,
        idempotency_key=row.idempotency_key, fencing_token=row.fencing_token,
        attempt_count=row.attempt_count, retry_base=row.retry_base,
    )  # fmt: skip
    run._state.adding = False
    attempt = Attempt(
        id=row.attempt_id, run=run, number=row.attempt_count,
        fencing_token=row.fencing_token, state=AttemptState.RUNNING, worker=worker,
        claim_id=claim_id, task_id=task_id, lease_expires_at=row.lease_expires_at,
        deadline_at=row.deadline_at, heartbeat_at=row.now,
        started_at=None if reserved else row.now,
    )  # fmt: skip
    attempt._state.adding = False
    if reserved:
        attempt.reserved_at = row.now  # the database's clock at the reservation
    return attempt


def runs_reserve(
    *,
    run_ids: list,
    worker: str,
    claim_id: uuid.UUID,
    published_at: dt.datetime | None = None,
    task_id: str = "",
    grace_seconds: float = 0.0,
) -> list[Attempt]:
    """queued -> running for the first attempts of a packed message's runs, in one
    statement: each run gets its own attempt, token and lease, but no start yet
    (`started_at` None: reserved), and as deadline the latest instant it can end (every run
    before it in the pack at its limit plus `grace_seconds`, the room a pack's hard limit
    gives each run, and itself at its limit). The worker starts them one after
    another and records each start with its outcome; when a pack's worker is lost, the
    reaper charges only the first unrecorded one and releases the others (`attempt_release`).

    Only first attempts of `at_least_once` runs are reserved: a retry, a replay or an
    `at_most_once` run is claimed when its turn comes (`run_claim`), so that an attempt
    that may have started is always known to have. Returns the attempts made, in the
    order of their ids (the order the worker runs them in), each with its run and spec."""
    rows = storage.runs.runs_reserve(run_ids=run_ids, worker=worker[:200], claim_id=claim_id,
                                     published_at=published_at, task_id=task_id[:64],
                                     grace_seconds=grace_seconds)  # fmt: skip
    return [_claimed_attempt(row, worker=worker[:200], claim_id=claim_id, task_id=task_id[:64],
                             reserved=True) for row in rows]  # fmt: skip


def attempts_still_running(*, attempt_ids: list[int]) -> set[int]:
    """Which of these attempts are still `running`: a reserved attempt cancelled or taken
    by the reaper before its turn is not started."""
    if not attempt_ids:
        return set()
    return set(
        Attempt.objects.filter(id__in=attempt_ids, state=AttemptState.RUNNING).values_list(
            "id", flat=True
        )
    )


# Ends the error of every released attempt, for people (`Attempt.released` marks it).
RELEASED_ERROR = "not started"


def attempt_release(
    *, attempt: Attempt, now: dt.datetime, error: str, only_if: Q | None = None
) -> bool:
    """running -> lost for a reserved attempt that never started (its pack ended first, or
    its pack's worker was lost while an earlier run of the pack was the one possibly
    running), and running -> retry_wait due at once for its run, without charging the
    attempt to the run's retry budget (`retry_base` moves with it): the promoter queues it
    again, and its next attempt is claimed at its turn."""
    return _finish(
        attempt,
        attempt_to=AttemptState.LOST,
        run_to=RunState.RETRY_WAIT,
        now=now,
        error=f"{error}; {RELEASED_ERROR}",
        released=True,
        only_if=Q(started_at__isnull=True) & (only_if or Q()),
        next_attempt_at=now,
        retry_base=F("retry_base") + 1,
    )


def _reserved_start(attempt: Attempt) -> dt.datetime | None:
    """A reserved attempt's start as its worker saw it (None: a claimed attempt, whose
    start the claim wrote, or one that never started)."""
    if getattr(attempt, "reserved_at", None) is None:
        return None
    return attempt.started_at


def attempts_renew_leases(
    *, leases: list[tuple[int, int, float]], now: dt.datetime | None = None
) -> storage.attempts.Renewal:
    """Extend the leases of running attempts that still hold the current token, in one
    statement: `leases` holds (attempt id, fencing token, lease seconds). Returns the ids
    renewed, and those whose row another transaction holds (neither renewed nor refused:
    ask again shortly); an attempt in neither lost its lease or token. `now` defaults to
    the database's clock; the condition is on the attempt row alone, and no row lock is
    waited for (`storage.attempts.attempts_renew_leases` says why)."""
    return storage.attempts.attempts_renew_leases(leases=leases, now=now)


def attempt_renew_lease(*, attempt: Attempt, now: dt.datetime, lease_seconds: float) -> bool:
    """Extend the lease of a running attempt that still holds the current token; False
    when it did not (refused, or its row held by another transaction)."""
    leases = [(attempt.id, attempt.fencing_token, lease_seconds)]
    return attempt.id in attempts_renew_leases(leases=leases, now=now).renewed


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
    now,
    error: str = "",
    only_if: Q | None = None,
    released: bool = False,
    **run_fields,
) -> bool:
    """The attempt leaves running and its run moves to `run_to`, both or neither, and only
    while the attempt holds the run's current fencing token. Two statements and no
    savepoint: the attempt's update is itself conditioned on its run still carrying its
    token, so once it won the run's update cannot lose (every path that moves a run out of
    `running` ends its running attempt in the same transaction, attempt row first).
    `now`: an instant, or an expression such as Now()."""
    current_run = Run.objects.filter(
        id=attempt.run_id, state=RunState.RUNNING, fencing_token=attempt.fencing_token
    )
    started = _reserved_start(attempt)
    attempt_fields = {"state": attempt_to, "finished_at": now, "error": error}
    if released:
        attempt_fields["released"] = True
    if started is not None:  # a reserved attempt's start, written with its outcome
        value = Value(started, output_field=DateTimeField())
        attempt_fields["started_at"] = Coalesce(F("started_at"), value)
        run_fields["started_at"] = Coalesce(F("started_at"), value)
    with transaction.atomic(savepoint=False):
        rows = Attempt.objects.filter(
            Exists(current_run),
            id=attempt.id,
            state=AttemptState.RUNNING,
            fencing_token=attempt.fencing_token,
        )
        if only_if is not None:
            rows = rows.filter(only_if)
        if not rows.update(**attempt_fields):
            return False
        if not _move_runs(
            [attempt.run_id],
            run_to,
            token=attempt.fencing_token,
            from_states=[RunState.RUNNING],
            **run_fields,
        ):
            # Only a hand edit of the run between the two statements gets here.
            raise RuntimeError(f"run {attempt.run_id} changed under its attempt's outcome")
        return True


def attempt_succeed(*, attempt: Attempt, now: dt.datetime | None = None, result=None) -> bool:
    """running -> succeeded, for the attempt and its run (`now`: by default the
    transaction's time on the database)."""
    at = now or Now()
    return _finish(
        attempt,
        attempt_to=AttemptState.SUCCEEDED,
        run_to=RunState.SUCCEEDED,
        now=at,
        finished_at=at,
        result=result,
        failure_reason="",
    )


def attempts_succeed(
    *, outcomes: list[tuple[Attempt, object]], manifests: Sequence = ()
) -> set[int]:
    """`attempt_succeed` for many attempts at once, each with its result: one statement
    (`storage.attempts.attempts_succeed`, after one that locks a pack's attempts in id
    order) updates the attempts and their runs together, each only while it holds its
    run's current token. The ids of the attempts that won; call inside a transaction.
    `manifests` (storage.logs.LogManifestRow): their log manifests, inserted by the same
    statement for the attempts that won."""
    succeeded = storage.attempts.attempts_succeed(
        manifests=manifests,
        successes=[
            storage.attempts.Success(
                attempt_id=attempt.id,
                run_id=attempt.run_id,
                token=attempt.fencing_token,
                result=result,
                # A reserved attempt's start, seen by its worker (None: a claimed one's).
                started_at=_reserved_start(attempt),
            )
            for attempt, result in outcomes
        ],
    )
    if succeeded.runs_moved != len(succeeded.won):
        # Only a hand edit of a run between the two updates gets here: undo them all.
        missing = len(succeeded.won) - succeeded.runs_moved
        raise RuntimeError(f"{missing} runs changed under their attempts' outcomes")
    return succeeded.won


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
