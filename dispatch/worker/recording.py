"""Recording a handler's outcome: its result made storable, a failure written at once, and
successes written together (one run's alone, or a pack's in batches)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import traceback

import sentry_sdk
from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection, transaction
from django.db.models.functions import Now

from jobs.clock import db_now
from jobs.counters import counter_increment
from jobs.models import Attempt, AttemptState, Run, RunState
from jobs.outcomes import Failure, Success, attempts_record_failure, attempts_record_success
from jobs.redaction import redact, redact_value
from logs_app.store import logs_discard, logs_manifests_alone, logs_seal, logs_seal_many

from ..errors import NonRetryableError
from .keeper import LEASE_KEEPER, Lease
from .outage import with_database_retries

log = logging.getLogger("dispatch.worker")
MAX_RESULT_BYTES = 64 * 1024
# A packed run's success waits at most this long for the others' to be recorded with it.
SUCCESS_BATCH_SECONDS = 0.05


def storable_result(value):
    """The handler's return value as the database can store it: JSON without NaN or NUL
    characters (PostgreSQL's jsonb refuses both), bounded in size, and with secret-looking
    values redacted (docs/security.md: a result is shown to operators and in the admin)."""
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


def ended_by(exc: BaseException) -> str:
    """How an attempt whose handler raised `exc` ends: timed out (Celery's soft limit), or
    failed."""
    return AttemptState.TIMED_OUT if isinstance(exc, SoftTimeLimitExceeded) else AttemptState.FAILED


def failure_text(exc: BaseException) -> str:
    """The handler's traceback as the attempt keeps it and the worker's log shows it: the
    last 8,000 characters, redacted (jobs.redaction)."""
    return redact("".join(traceback.format_exception(exc))[-8000:].replace("\x00", ""))


def log_failure(*, run: Run, attempt: Attempt, error: str, outcome: str | None) -> None:
    """The worker's console line for a handler that raised: failed (or to be retried), with
    its redacted traceback; never Celery's "succeeded", which only says the message was
    handled (scheduler_project/celery.py words it so)."""
    what = {"retry_wait": "failed; a retry follows", None: "failed (stale: not recorded)"}
    log.error(
        "run %s attempt %s of %s %s\n%s",
        run.id,
        attempt.number,
        run.job_version.spec["task"],
        what.get(outcome, "failed"),
        error.rstrip(),
    )


def failure_writer(
    *, run: Run, attempt: Attempt, exc: BaseException, worker: str, logs: dict,
    error: str | None = None,
):  # fmt: skip
    """The write of a handler's failure (`jobs.outcomes`, its logs sealed with it), for
    `with_database_retries`: the run's new state, or None when the attempt was stale.
    `error`: the exception's `failure_text`, when the caller has it already."""
    error = error if error is not None else failure_text(exc)
    failure = Failure(
        attempt=attempt,
        spec=run.job_version.spec,
        retry_base=run.retry_base,
        ended=ended_by(exc),
        error=error,
        retryable=not isinstance(exc, NonRetryableError),
    )

    def write() -> str | None:
        with transaction.atomic():
            now = db_now()
            outcomes = attempts_record_failure(failures=[failure], now=now, by=f"worker:{worker}")
            outcome = outcomes[attempt.id]
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


def report_failure(exc: BaseException, *, run: Run, attempt: Attempt) -> None:
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


def count_stale(run_id, attempt: Attempt) -> None:
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
        # Handlers that logged nothing: their manifests go in the success's own statement.
        alone = logs_manifests_alone([(item.attempt, item.logs) for item in items])
        with transaction.atomic():
            # One statement for the attempts and their runs (the hot path's form).
            won = attempts_record_success(
                successes=[Success(item.attempt, item.result) for item in items],
                manifests=alone or (),
            )
            if alone is None:
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

    won = with_database_retries(write) if retry else write()
    outcomes = {}
    for item in items:
        LEASE_KEEPER.release(item.lease)
        if item.attempt.id in won:
            outcomes[item.attempt.id] = RunState.SUCCEEDED
        else:
            logs_discard(item.logs["placed"])
            count_stale(item.attempt.run_id, item.attempt)
            outcomes[item.attempt.id] = "stale"
    return outcomes


def record_success(*, attempt: Attempt, result, logs: dict, lease: Lease) -> str:
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
