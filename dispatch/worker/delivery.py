"""One delivered run: claimed as an attempt (one statement), its handler run under the
process's lease keeper, and its outcome recorded while it holds the current fencing token."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable

from celery.exceptions import SoftTimeLimitExceeded
from django.db import InterfaceError, OperationalError, transaction

from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.services import run_record_duplicate_delivery
from jobs.transitions import run_claim
from logs_app.capture import LogCapture
from logs_app.store import logs_prepare

from ..failpoints import failpoint
from ..queues import queue_hand_back, queue_holds_run
from .context import RunContext
from .keeper import LEASE_KEEPER, Lease
from .limits import soft_time_limit
from .outage import adopting, with_database_retries
from .recording import (
    Successes,
    count_stale,
    failure_text,
    failure_writer,
    log_failure,
    record_success,
    report_failure,
    storable_result,
)

log = logging.getLogger("dispatch.worker")


# What a claim answers for a run its queue holds back (paused, or at its cap).
HANDED_BACK = "handed_back"
# The longest a delivered run of a rate-limited queue waits for its token before it is
# handed back (the relays keep two bursts of the queue in the broker: seconds, usually).
RATE_WAIT_SECONDS = 60.0


def _claim(
    *, run_id: str, worker: str, published_at: dt.datetime | None, task_id: str
) -> Attempt | str | None:
    """Claim the delivered run (one statement when its queue has no control in force;
    otherwise after its queue's gate: dispatch.queues),
    retrying through a database outage for a bounded time. None: not claimable (a duplicate
    delivery, a cancelled or unknown run); HANDED_BACK: its queue is paused or at its cap,
    and the run waits in PostgreSQL again, no attempt charged. A run of a rate-limited
    queue waits here for its token (up to RATE_WAIT_SECONDS, then it is handed back).

    A retry after an ambiguous commit adopts the attempt the first try may have made."""

    def adopt(claim_id: uuid.UUID) -> Attempt | None:
        return (
            Attempt.objects.select_related("run__job_version")
            .filter(run_id=run_id, claim_id=claim_id, state=AttemptState.RUNNING)
            .first()
        )

    def claim(claim_id: uuid.UUID) -> Attempt | str | float | None:
        # A queue without a control in force: the claim alone, one statement that reads
        # and share-locks the queue's control row itself. Otherwise (or when the run is
        # not claimable), the queue's gate first, in a transaction of its own.
        claimed = run_claim(
            run_id=run_id, worker=worker, claim_id=claim_id, published_at=published_at,
            task_id=task_id, gated=True,
        )  # fmt: skip
        if claimed is not None:
            return claimed
        with transaction.atomic():
            held = queue_holds_run(run_id=run_id)
            if held is True:
                return HANDED_BACK
            if held:
                return held  # the seconds until its queue's next token
            return run_claim(
                run_id=run_id, worker=worker, claim_id=claim_id, published_at=published_at,
                task_id=task_id,
            )  # fmt: skip

    deadline = time.monotonic() + RATE_WAIT_SECONDS
    while True:
        claimed = adopting(claim, adopt)
        if not isinstance(claimed, float):
            return claimed
        if time.monotonic() + claimed > deadline:
            queue_hand_back(run_id=run_id)
            return HANDED_BACK
        time.sleep(claimed)


def published_at_of(value: str | None) -> dt.datetime | None:
    """The relay's publication time, carried by the message (ISO 8601)."""
    try:
        return dt.datetime.fromisoformat(value) if value else None
    except (TypeError, ValueError):
        return None


def _finish_capture(capture: LogCapture, attempt: Attempt) -> dict:
    """What `logs_seal` needs: the capture's last chunks with their content placed, the
    count of lines dropped, and whether chunks were stored during the run. Celery's soft
    time limit landing here does not lose the outcome: it is finished anyway."""
    while True:
        try:
            chunks, dropped = capture.finish()
            return {
                "placed": logs_prepare(attempt=attempt, chunks=chunks),
                "dropped_lines": dropped,
                "shipped": capture.shipped > 0,
            }
        except SoftTimeLimitExceeded:
            log.warning("the soft time limit interrupted finishing the logs; finishing anyway")


def run_execute_delivery(
    *,
    run_id: str,
    handler: Callable,
    worker: str,
    message_id: str,
    published_at: str | None = None,
    time_limit: float | None = None,
    successes: Successes | None = None,
) -> dict:
    """Claim, run and complete one delivered run. Returns a summary for Celery's log;
    outcome `claim_failed` means the database stayed away and the caller must deliver the
    run again (dispatch.registry publishes the message anew). `time_limit`: the handler's
    own soft time limit, for runs packed in one message (whose Celery limit is the pack's);
    `successes`: the pack's batch, which records a success with the others'."""
    # The delivery is acknowledged already (early acknowledgement): a crash here leaves the
    # run `queued` with no message anywhere, for reconciliation to publish again.
    failpoint("worker.before_claim")
    try:
        attempt = _claim(
            run_id=run_id, worker=worker, published_at=published_at_of(published_at),
            task_id=message_id,
        )  # fmt: skip
    except (OperationalError, InterfaceError):
        log.error("could not claim run %s: the database is away", run_id)
        return {"run_id": run_id, "outcome": "claim_failed"}
    if attempt is None:
        return _refused(run_id=run_id, worker=worker, message_id=message_id)
    if attempt == HANDED_BACK:
        log.info("run %s handed back: its queue is paused or at its cap", run_id)
        return {"run_id": run_id, "outcome": HANDED_BACK}
    lease = LEASE_KEEPER.hold(attempt, attempt.run.job_version.spec["heartbeat_timeout_seconds"])
    try:
        return attempt_execute(
            attempt, lease, handler=handler, worker=worker, time_limit=time_limit,
            successes=successes,
        )  # fmt: skip
    except BaseException:
        # Whatever stopped it before an outcome was written (the lease is released once:
        # a second release of the same lease does nothing).
        LEASE_KEEPER.release(lease)
        raise


def _refused(*, run_id: str, worker: str, message_id: str) -> dict:
    """A delivered run that could not be claimed: cancelled, or a duplicate delivery."""
    # The state now, not as read before the claim: a cancel may have won in between.
    state = Run.objects.filter(id=run_id).values_list("state", flat=True).first()
    if state == RunState.CANCELLED:
        log.info("run %s was cancelled before a worker claimed it", run_id)
        return {"run_id": run_id, "outcome": "cancelled"}
    run_record_duplicate_delivery(run_id=run_id, worker=worker, message_id=message_id)
    log.info("refused a duplicate delivery of run %s", run_id)
    return {"run_id": run_id, "outcome": "refused"}


def attempt_execute(
    attempt: Attempt,
    lease: Lease,
    *,
    handler: Callable,
    worker: str,
    time_limit: float | None = None,
    successes: Successes | None = None,
) -> dict:
    """Run the claimed attempt's handler and record its outcome."""
    run = attempt.run
    spec = run.job_version.spec
    ctx = RunContext(
        run_id=str(run.id),
        job_id=str(run.job_id),
        attempt=attempt.number,
        idempotency_key=run.idempotency_key,
        fencing_token=attempt.fencing_token,
        scheduled_for=run.scheduled_for,
        payload_ref=spec.get("payload_ref"),
        logger=logging.LoggerAdapter(
            logging.getLogger(f"jobs.task.{spec['task']}"),
            {"run_id": str(run.id), "attempt": attempt.number},
        ),
        _attempt=attempt,
        _lease=lease,
    )
    capture = LogCapture(attempt)
    try:
        capture.start()
        returned = False
        try:
            with soft_time_limit(time_limit):
                result = handler(ctx, *spec["args"], **spec["kwargs"])
                returned = True
        except SoftTimeLimitExceeded:
            if not returned:
                raise  # an alarm landing after the handler returned is not its timeout
    except BaseException as exc:  # noqa: BLE001 - every handler error is the attempt's outcome
        # The lease stays renewed until the outcome is written: finishing the logs may take
        # a while, and the reaper must not take the run meanwhile.
        logs = _finish_capture(capture, attempt)
        lease.finishing = True
        report_failure(exc, run=run, attempt=attempt)
        error = failure_text(exc)
        write = failure_writer(
            run=run, attempt=attempt, exc=exc, error=error, worker=worker, logs=logs
        )
        if not isinstance(exc, Exception):
            # KeyboardInterrupt, SystemExit, CancelledError: recorded, then left to end the
            # task as they mean to; the lease is released either way.
            try:
                with_database_retries(write)
            finally:
                LEASE_KEEPER.release(lease)
            raise
    else:
        logs = _finish_capture(capture, attempt)
        lease.finishing = True
        result = storable_result(result)
        if successes is not None:
            successes.add(attempt=attempt, result=result, logs=logs, lease=lease)
            return {"run_id": str(run.id), "attempt": attempt.number, "outcome": "recording",
                    "attempt_id": attempt.id}  # fmt: skip
        outcome = record_success(attempt=attempt, result=result, logs=logs, lease=lease)
        return {"run_id": str(run.id), "attempt": attempt.number, "outcome": outcome}

    try:
        outcome = with_database_retries(write)
    finally:
        LEASE_KEEPER.release(lease)
    log_failure(run=run, attempt=attempt, error=error, outcome=outcome)
    if outcome is None:
        count_stale(str(run.id), attempt)
        outcome = "stale"
    return {"run_id": str(run.id), "attempt": attempt.number, "outcome": outcome}
