"""The worker runtime: claim a delivery as an attempt, keep its lease, run the handler,
and record the outcome only while the attempt still holds the current fencing token."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import TypeVar

import sentry_sdk
from celery.exceptions import SoftTimeLimitExceeded
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.db.models.functions import Now

from jobs.clock import db_now
from jobs.counters import counter_increment
from jobs.effects import EffectRecord, effect_once
from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.redaction import redact, redact_value
from jobs.services import (
    attempt_record_failure,
    attempt_release_unstarted,
    run_record_duplicate_delivery,
)
from jobs.transitions import (
    attempts_renew_leases,
    attempts_still_running,
    attempts_succeed,
    run_claim,
    runs_reserve,
)
from logs_app.capture import LogCapture
from logs_app.store import logs_discard, logs_prepare, logs_seal, logs_seal_many

from .errors import NonRetryableError

T = TypeVar("T")
log = logging.getLogger("dispatch.runtime")
# How long a finished attempt keeps trying to record its outcome while the database is down.
COMPLETION_RETRY_SECONDS = 60.0
# Seconds between Celery's soft time limit (the handler gets SoftTimeLimitExceeded) and its
# hard one (the pool process is killed; the reaper then records the attempt timed out).
HARD_TIME_LIMIT_GRACE = 15
MAX_RESULT_BYTES = 64 * 1024
# A packed run's success waits at most this long for the others' to be recorded with it.
SUCCESS_BATCH_SECONDS = 0.05


class Lease:
    """One attempt's lease, renewed by its process's LeaseKeeper while the handler runs."""

    def __init__(self, attempt: Attempt, lease_seconds: float) -> None:
        self.attempt = attempt
        self.lease_seconds = lease_seconds
        self.interval = max(0.5, lease_seconds / 3)
        self.renew_at = time.monotonic() + self.interval
        self.lost = threading.Event()
        # Set while the attempt's own outcome is written: a refusal that finds that outcome
        # recorded is not staleness.
        self.finishing = False
        self._renewed = threading.Condition()
        self._renewals = 0  # renewals attempted, successful or not

    @property
    def key(self) -> tuple[int, int, float]:
        return (self.attempt.id, self.attempt.fencing_token, self.lease_seconds)

    def renew(self) -> bool:
        """One renewal of this lease alone, from the calling thread; False once it is lost."""
        try:
            renewed = attempts_renew_leases(leases=[self.key])
        except DatabaseError:
            log.warning("lease renewal failed", exc_info=True)
            connection.close()
            return not self.lost.is_set()
        self.settle(self.attempt.id in renewed)
        return not self.lost.is_set()

    def settle(self, renewed: bool) -> None:
        """The outcome of a renewal: a refusal loses the lease, counted unless a cancel or
        the attempt's own outcome explains it."""
        if not renewed and not self.lost.is_set():
            self.lost.set()
            state = self._attempt_state()
            if state == AttemptState.CANCELLED:
                log.info("run %s was cancelled; the handler is asked to stop", self.attempt.run_id)
            elif self.finishing and state in (AttemptState.SUCCEEDED, AttemptState.FAILED):
                pass  # the attempt's own outcome just landed
            elif self.attempt.started_at is None:
                pass  # reserved, and ended before its turn: it never ran here
            else:
                counter_increment("scheduler_stale_completions_total", labels='kind="heartbeat"')
        with self._renewed:
            self._renewals += 1
            self._renewed.notify_all()

    def _attempt_state(self) -> str | None:
        try:
            return (
                Attempt.objects.filter(id=self.attempt.id).values_list("state", flat=True).first()
            )
        except DatabaseError:
            return None


class LeaseKeeper:
    """One thread per worker process renews the leases of every attempt the process runs,
    all in one statement, each on its own schedule (a third of its lease). A run shorter
    than that costs the keeper nothing; a heartbeat asks for a renewal now and waits for it.
    The thread starts with the first lease a process holds (after Celery's fork)."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._poke = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.failing = False  # renewals fail (the database is away): retry every half second
        self._batches: set[Successes] = set()

    def hold(self, attempt: Attempt, lease_seconds: float) -> Lease:
        lease = Lease(attempt, lease_seconds)
        with self._lock:
            self._leases[attempt.id] = lease
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
                self._thread.start()
        return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self._leases.get(lease.attempt.id) is lease:
                del self._leases[lease.attempt.id]
            idle = not self._leases
        if idle:
            self._poke.set()  # the keeper lets its connection go while it holds nothing

    def held(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def watch(self, batch: Successes) -> None:
        """Write `batch`'s successes once the oldest waited SUCCESS_BATCH_SECONDS, should the
        worker's thread still be busy with a later run of the pack."""
        with self._lock:
            self._batches.add(batch)
        self._poke.set()

    def unwatch(self, batch: Successes) -> None:
        with self._lock:
            self._batches.discard(batch)

    def renew_now(self, lease: Lease) -> bool:
        """A renewal made by the keeper's thread, on its own connection, waited for: a
        handler's heartbeat never writes inside the handler's own transaction (an open
        `ctx.effect` block would hold it back, and a failure would break that block)."""
        if lease.lost.is_set():
            return False
        with lease._renewed:
            seen = lease._renewals
            lease.renew_at = 0.0
            self._poke.set()
            lease._renewed.wait_for(
                lambda: lease._renewals > seen, timeout=max(lease.interval, 5.0)
            )
        return not lease.lost.is_set()

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - the keeper must outlive any one failure
                    log.exception("lease keeper step failed; retrying")
                    connection.close()
                    time.sleep(0.5)
        finally:
            connection.close()

    def _step(self) -> None:
        """Renew the leases due and write the successes that waited long enough, or sleep
        until the next is due (or a heartbeat or a new success pokes)."""
        leases = self.held()
        with self._lock:
            batches = list(self._batches)
        now = time.monotonic()
        due = [lease for lease in leases if lease.renew_at <= now]
        if due:
            self._renew(due)
            return
        waited = [batch for batch in batches if batch.write_at() <= now]
        if waited:
            for batch in waited:
                batch.write(retry=False)
            return
        if not leases and connection.connection is not None:
            # Only runs longer than a third of their lease ever renew: most never do, and
            # an idle process holds no connection for them.
            connection.close()
        wake = min(
            [lease.renew_at for lease in leases] + [batch.write_at() for batch in batches],
            default=now + 1.0,
        )
        self._poke.wait(min(wake - now, 0.5 if self.failing else 1.0))
        self._poke.clear()

    def _renew(self, due: list[Lease]) -> None:
        try:
            renewed = attempts_renew_leases(leases=[lease.key for lease in due])
        except DatabaseError:
            log.warning("lease renewal failed; retrying", exc_info=True)
            connection.close()
            self.failing = True
            for lease in due:
                lease.renew_at = time.monotonic() + 0.5
                with lease._renewed:  # a waiting heartbeat learns nothing new, but returns
                    lease._renewals += 1
                    lease._renewed.notify_all()
            return
        self.failing = False
        for lease in due:
            lease.renew_at = time.monotonic() + lease.interval
            lease.settle(lease.attempt.id in renewed)
            if lease.lost.is_set():
                self.release(lease)


# The process's keeper (each Celery pool process has its own, after the fork).
LEASE_KEEPER = LeaseKeeper()


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
    _lease: Lease

    def heartbeat(self) -> bool:
        """Renew the lease now; False means this attempt is no longer the run's owner."""
        return LEASE_KEEPER.renew_now(self._lease)

    @property
    def cancel_requested(self) -> bool:
        """True once the handler should stop: the run was cancelled, or this attempt lost
        its lease (another attempt may own the run now). Seen at the next heartbeat."""
        return self._lease.lost.is_set()

    def effect(self, name: str) -> contextlib.AbstractContextManager[EffectRecord]:
        """Record an effect once per run, in a transaction fenced by this attempt's token
        (`jobs.effects.effect_once`): database writes made inside the block commit with the
        ledger row, and only if this attempt is still current; `record.done` tells a later
        execution of the same run that the effect was already committed."""
        return effect_once(run_id=self.run_id, name=name, attempt_number=self.attempt,
                           fencing_token=self.fencing_token)  # fmt: skip


def _storable_result(value):
    """The handler's return value as the database can store it: JSON without NaN or NUL
    characters (PostgreSQL's jsonb refuses both), bounded in size, and with secret-looking
    values redacted (SPEC, "Security": a result is shown to operators and in the admin)."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        text = json.dumps(repr(value)[:MAX_RESULT_BYTES])
    if len(text) > MAX_RESULT_BYTES:
        return {"truncated": True, "preview": redact(text[:1000])}
    return redact_value(_without_nul(json.loads(text)))


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


def _claim(
    *, run_id: str, worker: str, published_at: dt.datetime | None, task_id: str
) -> Attempt | None:
    """Claim the delivered run (one statement), retrying through a database outage for a
    bounded time. None: not claimable (a duplicate delivery, a cancelled or unknown run).

    A retry after an ambiguous commit adopts the attempt the first try may have made."""

    def adopt(claim_id: uuid.UUID) -> Attempt | None:
        return (
            Attempt.objects.select_related("run__job_version")
            .filter(run_id=run_id, claim_id=claim_id, state=AttemptState.RUNNING)
            .first()
        )

    def claim(claim_id: uuid.UUID) -> Attempt | None:
        return run_claim(
            run_id=run_id, worker=worker, claim_id=claim_id, published_at=published_at,
            task_id=task_id,
        )  # fmt: skip

    return _adopting(claim, adopt)


def _adopting(claim: Callable[[uuid.UUID], T], adopt: Callable[[uuid.UUID], T]) -> T:
    """`claim(claim_id)` retried through a database outage for a bounded time (the claim's
    id is one for all tries); a retry after an ambiguous commit first adopts what the
    first try may have made (`adopt(claim_id)`, falsy when it made nothing)."""
    claim_id = uuid.uuid4()
    tries = 0

    def attempt() -> T:
        nonlocal tries
        tries += 1
        if tries > 1 and (mine := adopt(claim_id)):
            return mine
        return claim(claim_id)

    return _with_database_retries(attempt)


def _published_at(value: str | None) -> dt.datetime | None:
    """The relay's publication time, carried by the message (ISO 8601)."""
    try:
        return dt.datetime.fromisoformat(value) if value else None
    except (TypeError, ValueError):
        return None


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
    time_limit: float | None = None,
    successes: Successes | None = None,
) -> dict:
    """Claim, run and complete one delivered run. Returns a summary for Celery's log;
    outcome `claim_failed` means the database stayed away and the caller must deliver the
    run again (dispatch.registry publishes the message anew). `time_limit`: the handler's
    own soft time limit, for runs packed in one message (whose Celery limit is the pack's);
    `successes`: the pack's batch, which records a success with the others'."""
    try:
        attempt = _claim(
            run_id=run_id, worker=worker, published_at=_published_at(published_at),
            task_id=message_id,
        )  # fmt: skip
    except (OperationalError, InterfaceError):
        log.error("could not claim run %s: the database is away", run_id)
        return {"run_id": run_id, "outcome": "claim_failed"}
    if attempt is None:
        return _refused(run_id=run_id, worker=worker, message_id=message_id)
    lease = LEASE_KEEPER.hold(attempt, attempt.run.job_version.spec["heartbeat_timeout_seconds"])
    try:
        return _execute(
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


def _execute(
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
            with _soft_time_limit(time_limit):
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
        _report_failure(exc, run=run, attempt=attempt)
        write = _failure_writer(run=run, attempt=attempt, exc=exc, worker=worker, logs=logs)
        if not isinstance(exc, Exception):
            # KeyboardInterrupt, SystemExit, CancelledError: recorded, then left to end the
            # task as they mean to; the lease is released either way.
            try:
                _with_database_retries(write)
            finally:
                LEASE_KEEPER.release(lease)
            raise
    else:
        logs = _finish_capture(capture, attempt)
        lease.finishing = True
        result = _storable_result(result)
        if successes is not None:
            successes.add(attempt=attempt, result=result, logs=logs, lease=lease)
            return {"run_id": str(run.id), "attempt": attempt.number, "outcome": "recording",
                    "attempt_id": attempt.id}  # fmt: skip
        outcome = _record_success(attempt=attempt, result=result, logs=logs, lease=lease)
        return {"run_id": str(run.id), "attempt": attempt.number, "outcome": outcome}

    try:
        outcome = _with_database_retries(write)
    finally:
        LEASE_KEEPER.release(lease)
    if outcome is None:
        _count_stale(str(run.id), attempt)
        outcome = "stale"
    return {"run_id": str(run.id), "attempt": attempt.number, "outcome": outcome}


def _report_failure(exc: BaseException, *, run: Run, attempt: Attempt) -> None:
    """A handler's exception to Sentry, when SENTRY_DSN set it up: the worker records it
    as the attempt's outcome, so Celery's integration never sees it escape the task."""
    if not isinstance(exc, Exception) or not sentry_sdk.is_initialized():
        return
    with sentry_sdk.new_scope() as scope:
        scope.set_tag("task", run.job_version.spec["task"])
        scope.set_tag("run_id", str(run.id))
        scope.set_tag("job_id", str(run.job_id))
        scope.set_tag("attempt", str(attempt.number))
        sentry_sdk.capture_exception(exc)


def _count_stale(run_id, attempt: Attempt) -> None:
    counter_increment("scheduler_stale_completions_total", labels='kind="completion"')
    log.warning("stale completion of run %s attempt %s refused", run_id, attempt.number)


@dataclasses.dataclass
class _Success:
    attempt: Attempt
    result: object
    logs: dict
    lease: Lease


def _succeeded(items: list[_Success], *, retry: bool = True) -> dict[int, str]:
    """Record succeeded attempts in one transaction of a few statements (attempts and runs
    in one, the log manifests in one or two), each only while it holds its run's current
    token; a refused one is stale, counted, its logs discarded. Returns each attempt's
    outcome and releases their leases. `retry=False`: one try, raising on a database error
    with the leases still held."""

    def write() -> set[int]:
        with transaction.atomic():
            # One statement for the attempts and their runs (the hot path's form).
            won = attempts_succeed(outcomes=[(item.attempt, item.result) for item in items])
            # The logs are complete whenever the run shows its success.
            logs_seal_many(
                [(item.attempt, item.logs) for item in items if item.attempt.id in won],
                now=Now(),
            )
        refused = [item.attempt.id for item in items if item.attempt.id not in won]
        if refused:
            # Refused, yet succeeded: a retry after an ambiguous commit of this very write.
            won |= set(
                Attempt.objects.filter(id__in=refused, state=AttemptState.SUCCEEDED).values_list(
                    "id", flat=True
                )
            )
        return won

    won = _with_database_retries(write) if retry else write()
    outcomes = {}
    for item in items:
        LEASE_KEEPER.release(item.lease)
        if item.attempt.id in won:
            outcomes[item.attempt.id] = RunState.SUCCEEDED
        else:
            logs_discard(item.logs["placed"])
            _count_stale(item.attempt.run_id, item.attempt)
            outcomes[item.attempt.id] = "stale"
    return outcomes


def _record_success(*, attempt: Attempt, result, logs: dict, lease: Lease) -> str:
    """One run's success, recorded at once (`_succeeded`; if it raises, the caller,
    `run_execute_delivery`, releases the lease)."""
    return _succeeded([_Success(attempt, result, logs, lease)])[attempt.id]


class Successes:
    """The successes of one packed message's runs, recorded together: the worker's thread
    adds each as its handler returns and writes what is left when the pack ends; the lease
    keeper writes those that waited SUCCESS_BATCH_SECONDS, so that a long run late in the
    pack does not hold back the successes before it. One writer at a time."""

    def __init__(self) -> None:
        self._pending: list[_Success] = []
        self._since: float | None = None  # when the oldest pending success was added
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self.outcomes: dict[int, str] = {}

    def add(self, *, attempt: Attempt, result, logs: dict, lease: Lease) -> None:
        with self._lock:
            self._pending.append(_Success(attempt, result, logs, lease))
            first = self._since is None
            if first:
                self._since = time.monotonic()
        if first:
            LEASE_KEEPER.watch(self)

    def write_at(self) -> float:
        since = self._since
        return math.inf if since is None else since + SUCCESS_BATCH_SECONDS

    def write(self, *, retry: bool = True) -> None:
        """Write the pending successes. `retry=False` (the keeper): one try, and on an
        error they stay pending for its next try or the worker's own write."""
        with self._writing:
            with self._lock:
                items, self._pending, self._since = self._pending, [], None
            if not items:
                return
            if retry:
                try:
                    self.outcomes.update(_succeeded(items))
                except BaseException:
                    for item in items:
                        LEASE_KEEPER.release(item.lease)
                    raise
                return
            try:
                self.outcomes.update(_succeeded(items, retry=False))
            except Exception as exc:  # noqa: BLE001 - the worker's own write retries them
                log.warning("recording %d packed successes failed (%s); retrying", len(items), exc)
                connection.close()
                with self._lock:
                    self._pending[:0] = items
                    # Not before a second from now: an outage is not retried in a busy loop.
                    self._since = time.monotonic() + 1.0


class PackInterrupted(Exception):
    """A run of a packed message ended the task (a BaseException from its handler, or a
    failure to record its outcome): the runs after it must be delivered again."""

    def __init__(self, remaining: list[str]) -> None:
        super().__init__(f"{len(remaining)} runs of the pack not reached")
        self.remaining = remaining


def run_execute_deliveries(
    *,
    run_ids: list[str],
    handler: Callable,
    worker: str,
    message_id: str,
    published_at: str | None = None,
    time_limit: float | None = None,
) -> dict:
    """The runs of one message (the relay packs short runs of one task), one after another,
    each with its own attempt, lease, token and time limit.

    The first attempts of `at_least_once` runs are reserved together, in one statement
    (`runs_reserve`): `running`, with a lease the process's keeper renews, but not started
    until their turn. Before its turn a reserved run is looked at again (`Pack`): one that
    was cancelled, or taken by the reaper, meanwhile is not started. Every other run (a
    retry, a replay, `at_most_once`, a duplicate delivery) is claimed when its turn comes
    (`run_execute_delivery`). Successes are recorded together (`Successes`); a reserved
    run's start is recorded with its outcome.

    Reserved runs go first, in the order of their attempts, then the others. Outcome
    `claim_failed` carries the unreserved runs still to deliver (`remaining`); anything else
    that stops the pack releases the reserved runs not reached (`attempt_release`: back to
    their queue through the outbox, their attempt not charged) and raises PackInterrupted
    (from its cause) with the unreserved runs not reached."""
    try:
        # Only where the worker enforces each run's time limit itself (SIGALRM, in a pool
        # process's main thread): a reserved attempt's deadline is only the latest its pack
        # lets it end, too loose to be its limit.
        reserved = (
            _reserve(
                run_ids=run_ids,
                worker=worker,
                published_at=_published_at(published_at),
                task_id=message_id,
            )  # fmt: skip
            if _enforces_time_limits()
            else []
        )
    except (OperationalError, InterfaceError):
        log.error("could not claim the %d runs of a pack: the database is away", len(run_ids))
        return {"outcome": "claim_failed", "remaining": list(run_ids), "runs": []}
    pack = Pack(reserved)
    order = [str(attempt.run_id) for attempt in reserved]
    order += [run_id for run_id in run_ids if run_id not in pack.by_run]
    successes = Successes()
    summaries: list[dict] = []
    try:
        for index, run_id in enumerate(order):
            if run_id not in pack.by_run and not _written_before_claim(successes):
                remaining = pack.hand_back(order[index:])
                return {"outcome": "claim_failed", "remaining": remaining, "runs": summaries}
            try:
                if run_id in pack.by_run:
                    summary = pack.run(run_id, handler=handler, worker=worker,
                                       time_limit=time_limit, successes=successes)  # fmt: skip
                else:
                    summary = run_execute_delivery(
                        run_id=run_id, handler=handler, worker=worker, message_id=message_id,
                        published_at=published_at, time_limit=time_limit, successes=successes,
                    )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - the rest of the pack must not be lost
                # This run's own attempt, if claimed, is recorded or left to its lease.
                remaining = pack.hand_back(order[index + 1 :])
                if not remaining:
                    raise
                raise PackInterrupted(remaining) from exc
            if summary["outcome"] == "claim_failed":
                remaining = pack.hand_back(order[index:])
                return {"outcome": "claim_failed", "remaining": remaining, "runs": summaries}
            summaries.append(summary)
    finally:
        try:
            successes.write()
        except DatabaseError:
            # The database stayed away past the retries: the successes' leases lapse and
            # the reaper retries them; this does not replace what ends the pack.
            log.error("could not record the successes of a pack; their leases will lapse")
        finally:
            LEASE_KEEPER.unwatch(successes)
    for summary in summaries:
        if summary["outcome"] == "recording":
            summary["outcome"] = successes.outcomes[summary.pop("attempt_id")]
    position = {run_id: index for index, run_id in enumerate(run_ids)}
    summaries.sort(key=lambda summary: position.get(summary["run_id"], 0))  # as delivered
    return {"outcome": "done", "runs": summaries}


def _written_before_claim(successes: Successes) -> bool:
    """Write the pack's pending successes before a run is claimed at its turn: it may be a
    retry of one that kills its process, and must not take its pack-mates' outcomes with
    it. False when the database stayed away (the caller delivers the rest again)."""
    try:
        successes.write()
    except DatabaseError:
        log.error("could not record a pack's successes before a claim: the database is away")
        return False
    return True


def _reserve(
    *, run_ids: list[str], worker: str, published_at: dt.datetime | None, task_id: str
) -> list[Attempt]:
    """`runs_reserve`, retrying through a database outage for a bounded time; a retry
    after an ambiguous commit adopts the attempts the first try may have made."""

    def reserve(claim_id: uuid.UUID) -> list[Attempt]:
        return runs_reserve(run_ids=run_ids, worker=worker, claim_id=claim_id,
                            published_at=published_at, task_id=task_id,
                            grace_seconds=PACK_RUN_GRACE_SECONDS)  # fmt: skip

    return _adopting(reserve, _adopt_reserved)


def _adopt_reserved(claim_id: uuid.UUID) -> list[Attempt]:
    attempts = list(
        Attempt.objects.select_related("run__job_version")
        .filter(claim_id=claim_id, state=AttemptState.RUNNING, started_at__isnull=True)
        .order_by("id")
    )
    for attempt in attempts:
        attempt.reserved_at = attempt.heartbeat_at
    return attempts


# The room a packed message's hard limit gives each run beyond its own limit (its grace,
# and the claim's and the outcome's retries through an outage; dispatch.relay): a reserved
# run's deadline leaves it to every run before it.
PACK_RUN_GRACE_SECONDS = HARD_TIME_LIMIT_GRACE + int(2 * COMPLETION_RETRY_SECONDS)
# A reserved run is looked at again before it starts unless its pack looked this recently.
RESERVED_CHECK_SECONDS = 0.02


class Pack:
    """A packed message's reserved attempts: each held by the process's lease keeper from
    the reservation on, started at its turn unless it was ended meanwhile."""

    def __init__(self, reserved: list[Attempt]) -> None:
        self.by_run = {str(attempt.run_id): attempt for attempt in reserved}
        self.leases = {
            str(attempt.run_id): LEASE_KEEPER.hold(
                attempt, attempt.run.job_version.spec["heartbeat_timeout_seconds"]
            )
            for attempt in reserved
        }
        self._reserved_at = time.monotonic()
        self._checked_at = self._reserved_at
        self._waiting = set(self.by_run)

    def _started_at(self, attempt: Attempt) -> dt.datetime:
        """Now, on the database's clock: its time at the reservation plus the time since."""
        return attempt.reserved_at + dt.timedelta(seconds=time.monotonic() - self._reserved_at)

    def _ended_meanwhile(self, attempt: Attempt, lease: Lease) -> bool:
        if lease.lost.is_set():
            return True
        if time.monotonic() - self._checked_at < RESERVED_CHECK_SECONDS:
            return False
        waiting = [self.by_run[run_id].id for run_id in self._waiting]
        running = _with_database_retries(lambda: attempts_still_running(attempt_ids=waiting))
        self._checked_at = time.monotonic()
        for run_id in list(self._waiting):
            if self.by_run[run_id].id not in running:
                self.leases[run_id].lost.set()
        return lease.lost.is_set()

    def run(
        self,
        run_id: str,
        *,
        handler: Callable,
        worker: str,
        time_limit: float | None,
        successes: Successes,
    ) -> dict:
        attempt, lease = self.by_run[run_id], self.leases[run_id]
        try:
            ended_meanwhile = self._ended_meanwhile(attempt, lease)
            self._waiting.discard(run_id)
            if ended_meanwhile:
                LEASE_KEEPER.release(lease)
                state = Attempt.objects.filter(id=attempt.id).values_list("state", flat=True)
                ended = state.first()
                log.info("reserved run %s ended (%s) before its turn; not started", run_id, ended)
                outcome = "cancelled" if ended == AttemptState.CANCELLED else "lost"
                return {"run_id": run_id, "attempt": attempt.number, "outcome": outcome}
            attempt.started_at = self._started_at(attempt)
            return _execute(attempt, lease, handler=handler, worker=worker,
                            time_limit=time_limit, successes=successes)  # fmt: skip
        except BaseException:
            LEASE_KEEPER.release(lease)
            if attempt.started_at is None:  # it failed before its start: never ran
                self.release([run_id])
            raise

    def hand_back(self, run_ids: list[str]) -> list[str]:
        """The runs of `run_ids` not started here: the reserved ones are released, the
        others returned, to be delivered again."""
        self.release(run_ids)
        return [run_id for run_id in run_ids if run_id not in self.by_run]

    def release(self, run_ids: list[str]) -> None:
        """The reserved runs among `run_ids` never start here: their attempts end unstarted
        and uncharged, their runs go back to their queue through the outbox. Through a
        database outage their leases lapse instead, and the reaper releases them."""
        for run_id in run_ids:
            if run_id not in self.by_run:
                continue
            self._waiting.discard(run_id)
            attempt, lease = self.by_run[run_id], self.leases[run_id]
            LEASE_KEEPER.release(lease)
            try:
                attempt_release_unstarted(attempt=attempt, by=f"worker:{attempt.worker}",
                                          error="its pack ended before its turn")  # fmt: skip
            except DatabaseError:
                log.warning("could not release reserved run %s; its lease will lapse", run_id)
                connection.close()


def _enforces_time_limits() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


@contextlib.contextmanager
def _soft_time_limit(seconds: float | None):
    """Celery's soft time limit for one run inside a packed message: SIGALRM raises
    SoftTimeLimitExceeded in the handler, as the pool's own limit would. Only in the main
    thread of a process that has the signal (prefork, solo); elsewhere the reaper's
    `deadline_at` is the limit, as for the pools that cannot enforce Celery's."""
    if not seconds or not _enforces_time_limits():
        yield
        return

    def expire(signum, frame):
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
