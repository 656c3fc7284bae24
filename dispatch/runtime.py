"""The worker runtime: claim a delivery as an attempt, keep its lease, run the handler,
and record the outcome only while the attempt still holds the current fencing token."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction

from jobs.clock import db_now
from jobs.counters import counter_increment
from jobs.effects import EffectRecord, effect_once
from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.services import attempt_record_failure, run_record_duplicate_delivery
from jobs.transitions import attempt_renew_lease, attempt_succeed, run_claim
from logs_app.capture import LogCapture
from logs_app.redaction import redact
from logs_app.store import logs_discard, logs_prepare, logs_seal

from .errors import NonRetryableError

T = TypeVar("T")
log = logging.getLogger("dispatch.runtime")
# How long a finished attempt keeps trying to record its outcome while the database is down.
COMPLETION_RETRY_SECONDS = 60.0
MAX_RESULT_BYTES = 64 * 1024


class LeaseKeeper:
    """Renews the attempt's lease from a thread while the handler runs."""

    def __init__(self, attempt: Attempt, lease_seconds: float) -> None:
        self.attempt = attempt
        self.lease_seconds = lease_seconds
        self.interval = max(0.5, lease_seconds / 3)
        self.lost = threading.Event()
        # While renewals fail (the database is away), retry every half second, so that the
        # lease is renewed as soon as it returns, before the reaper's next look.
        self.failing = False
        # Set while the attempt's own outcome is written: a refusal that finds that outcome
        # recorded is not staleness.
        self.finishing = False
        self._stop = threading.Event()
        self._poke = threading.Event()  # renew now: a heartbeat asked, or stop
        self._waiters: list[threading.Event] = []
        self._waiters_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        self._thread.join(timeout=10)

    def renew_now(self) -> bool:
        """A renewal made by the keeper's thread, on its own connection, waited for: a
        handler's heartbeat never writes inside the handler's own transaction (an open
        `ctx.effect` block would hold it back, and a failure would break that block)."""
        if not self._thread.is_alive():
            return not self.lost.is_set()
        done = threading.Event()
        with self._waiters_lock:
            self._waiters.append(done)
        self._poke.set()
        done.wait(timeout=max(self.interval, 5.0))
        return not self.lost.is_set()

    def _release_waiters(self) -> None:
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, []
        for done in waiters:
            done.set()

    def renew(self) -> bool:
        """One renewal; False once the attempt lost its lease or token."""
        try:
            renewed = attempt_renew_lease(
                attempt=self.attempt, now=db_now(), lease_seconds=self.lease_seconds
            )
        except DatabaseError:
            log.warning("lease renewal failed; retrying", exc_info=True)
            connection.close()
            self.failing = True
            return not self.lost.is_set()
        self.failing = False
        if not renewed and not self.lost.is_set():
            self.lost.set()
            state = self._attempt_state()
            if state == AttemptState.CANCELLED:
                log.info("run %s was cancelled; the handler is asked to stop", self.attempt.run_id)
            elif self.finishing and state in (AttemptState.SUCCEEDED, AttemptState.FAILED):
                pass  # the attempt's own outcome just landed
            else:
                counter_increment("scheduler_stale_completions_total", labels='kind="heartbeat"')
        return renewed

    def _attempt_state(self) -> str | None:
        """Why a renewal was refused: a cancel or the attempt's own outcome are not
        staleness, and are not counted as such."""
        try:
            return (
                Attempt.objects.filter(id=self.attempt.id).values_list("state", flat=True).first()
            )
        except DatabaseError:
            return None

    def _run(self) -> None:
        try:
            while True:
                self._poke.wait(0.5 if self.failing else self.interval)
                self._poke.clear()
                if self._stop.is_set() or self.lost.is_set():
                    break
                self.renew()
                self._release_waiters()
        finally:
            self._release_waiters()
            connection.close()


@dataclasses.dataclass
class RunContext:
    """What a handler receives as `ctx`."""

    run_id: str
    job_id: str
    attempt: int
    idempotency_key: str
    fencing_token: int
    scheduled_for: dt.datetime
    payload_ref: str | None
    logger: logging.LoggerAdapter
    _attempt: Attempt
    _keeper: LeaseKeeper

    def heartbeat(self) -> bool:
        """Renew the lease now; False means this attempt is no longer the run's owner."""
        return self._keeper.renew_now()

    @property
    def cancel_requested(self) -> bool:
        """True once the handler should stop: the run was cancelled, or this attempt lost
        its lease (another attempt may own the run now). Seen at the next heartbeat."""
        return self._keeper.lost.is_set()

    def effect(self, name: str) -> contextlib.AbstractContextManager[EffectRecord]:
        """Record an effect once per run, in a transaction fenced by this attempt's token
        (`jobs.effects.effect_once`): database writes made inside the block commit with the
        ledger row, and only if this attempt is still current; `record.done` tells a later
        execution of the same run that the effect was already committed."""
        return effect_once(run_id=self.run_id, name=name, attempt_number=self.attempt,
                           fencing_token=self.fencing_token)  # fmt: skip


def _storable_result(value):
    """The handler's return value as the database can store it: JSON without NaN or NUL
    characters (PostgreSQL's jsonb refuses both), and bounded in size."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        text = json.dumps(repr(value)[:MAX_RESULT_BYTES])
    if len(text) > MAX_RESULT_BYTES:
        return {"truncated": True, "preview": text[:1000]}
    return _without_nul(json.loads(text))


def _without_nul(value):
    if isinstance(value, str):
        return value.replace("\x00", "")
    if isinstance(value, list):
        return [_without_nul(item) for item in value]
    if isinstance(value, dict):
        return {_without_nul(key): _without_nul(item) for key, item in value.items()}
    return value


def _with_database_retries(write: Callable[[], T]) -> T:
    """Record an outcome through a database outage, for a bounded time."""
    deadline = time.monotonic() + COMPLETION_RETRY_SECONDS
    delay = 0.2
    while True:
        try:
            return write()
        except SoftTimeLimitExceeded:
            # Celery's soft limit landed during the write itself: the outcome is known, so
            # record it anyway (the hard limit, 15 s later, still bounds the process).
            log.warning("the soft time limit interrupted recording an outcome; retrying")
            continue
        except (OperationalError, InterfaceError):  # the database is unreachable, not the data
            if time.monotonic() > deadline:
                raise
            log.warning("recording an outcome failed; retrying in %.1fs", delay, exc_info=True)
            connection.close()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _parse_instant(text: str | None) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text) if text else None
    except ValueError:  # a malformed stamp costs only the stage timestamp
        return None


def _claim(
    *, run_id: str, worker: str, published_at: dt.datetime | None = None
) -> tuple[Run | None, Attempt | None]:
    """Claim the delivered run, retrying through a database outage for a bounded time.

    The message was acknowledged when the pool accepted it (docs/semantics.md), so giving
    up here loses nothing: the run stays queued and reconciliation publishes it again."""

    claim_id = uuid.uuid4()
    tries = []

    def claim() -> tuple[Run | None, Attempt | None]:
        tries.append(1)
        run = Run.objects.select_related("job_version").filter(id=run_id).first()
        if run is None:
            return None, None
        if len(tries) > 1:
            # A retry after an ambiguous commit: the first try may have claimed it after all.
            mine = Attempt.objects.filter(
                run_id=run_id, claim_id=claim_id, state=AttemptState.RUNNING
            ).first()
            if mine is not None:
                return run, mine
        spec = run.job_version.spec
        return run, run_claim(
            run_id=run_id,
            worker=worker,
            now=db_now(),
            lease_seconds=spec["heartbeat_timeout_seconds"],
            timeout_seconds=spec.get("timeout_seconds"),
            claim_id=claim_id,
            published_at=published_at,
        )

    return _with_database_retries(claim)


def _ended(exc: BaseException) -> str:
    """How an attempt whose handler raised `exc` ends: timed out (Celery's soft limit), or
    failed."""
    return AttemptState.TIMED_OUT if isinstance(exc, SoftTimeLimitExceeded) else AttemptState.FAILED


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


def _failure_writer(*, run: Run, attempt: Attempt, exc: BaseException, worker: str, logs: dict):
    error = redact("".join(traceback.format_exception(exc))[-8000:].replace("\x00", ""))
    ended = _ended(exc)

    def write() -> str | None:
        with transaction.atomic():
            now = db_now()
            outcome = attempt_record_failure(
                attempt=attempt,
                spec=run.job_version.spec,
                retry_base=run.retry_base,
                ended=ended,
                error=error,
                now=now,
                by=f"worker:{worker}",
                retryable=not isinstance(exc, NonRetryableError),
            )
            if outcome is not None:
                logs_seal(attempt=attempt, now=now, **logs)
        if (
            outcome is None
            and Attempt.objects.filter(
                id=attempt.id, state__in=[AttemptState.FAILED, AttemptState.TIMED_OUT], error=error
            ).exists()
        ):
            # A retry after an ambiguous commit: the first try did record this failure.
            return Run.objects.filter(id=run.id).values_list("state", flat=True).first()
        if outcome is None:
            logs_discard(logs["placed"])
        return outcome

    return write


def run_execute_delivery(
    *,
    run_id: str,
    handler: Callable,
    worker: str,
    message_id: str,
    published_at: str | None = None,
) -> dict:
    """Claim, run and complete one delivered run. Returns a summary for Celery's log.
    `published_at` (ISO 8601, from the message) is recorded by the claim."""
    try:
        run, attempt = _claim(
            run_id=run_id, worker=worker, published_at=_parse_instant(published_at)
        )
    except (OperationalError, InterfaceError):
        log.error("could not claim run %s; reconciliation will publish it again", run_id)
        return {"run_id": run_id, "outcome": "claim_failed"}
    if attempt is None:
        # The state now, not as read before the claim: a cancel may have won in between.
        state = Run.objects.filter(id=run_id).values_list("state", flat=True).first()
        if state == RunState.CANCELLED:
            log.info("run %s was cancelled before a worker claimed it", run_id)
            return {"run_id": run_id, "outcome": "cancelled"}
        run_record_duplicate_delivery(run_id=run_id, worker=worker, message_id=message_id)
        log.info("refused a duplicate delivery of run %s", run_id)
        return {"run_id": run_id, "outcome": "refused"}

    spec = run.job_version.spec
    keeper = LeaseKeeper(attempt, spec["heartbeat_timeout_seconds"]).start()
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
        _keeper=keeper,
    )
    capture = LogCapture(attempt)
    try:
        capture.start()
        result = handler(ctx, *spec["args"], **spec["kwargs"])
    except BaseException as exc:  # noqa: BLE001 - every handler error is the attempt's outcome
        # The lease stays renewed until the outcome is written: finishing the logs may take
        # a while, and the reaper must not take the run meanwhile.
        logs = _finish_capture(capture, attempt)
        keeper.finishing = True
        write = _failure_writer(run=run, attempt=attempt, exc=exc, worker=worker, logs=logs)
        if not isinstance(exc, Exception):
            # KeyboardInterrupt, SystemExit, CancelledError: recorded, then left to end the
            # task as they mean to; the lease keeper is stopped either way.
            try:
                _with_database_retries(write)
            finally:
                keeper.stop()
            raise
    else:
        logs = _finish_capture(capture, attempt)
        keeper.finishing = True

        def write() -> str | None:
            with transaction.atomic():
                now = db_now()
                won = attempt_succeed(attempt=attempt, now=now, result=_storable_result(result))
                if won:  # the logs are complete whenever the run shows its success
                    logs_seal(attempt=attempt, now=now, **logs)
            # Refused, yet succeeded: a retry after an ambiguous commit of this very write.
            won = won or (
                Attempt.objects.filter(id=attempt.id, state=AttemptState.SUCCEEDED).exists()
            )
            if not won:
                logs_discard(logs["placed"])
            return RunState.SUCCEEDED if won else None

    try:
        outcome = _with_database_retries(write)
    finally:
        keeper.stop()
    if outcome is None:
        counter_increment("scheduler_stale_completions_total", labels='kind="completion"')
        log.warning("stale completion of run %s attempt %s refused", run_id, attempt.number)
        outcome = "stale"
    return {"run_id": run_id, "attempt": attempt.number, "outcome": outcome}
