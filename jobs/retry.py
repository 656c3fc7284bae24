"""Retry policy: exponential backoff with a cap and optional full jitter, and the decision
to retry or fail a run whose attempt did not succeed."""

import dataclasses
import datetime as dt
import random

from .models import AttemptState, FailureReason

DEFAULT_RETRY = {
    "max_attempts": 3,
    "initial_delay_seconds": 10,
    "backoff_factor": 2.0,
    "max_delay_seconds": 3600,
    "jitter": True,
}


def retry_delay_seconds(
    policy: dict, *, attempt_number: int, rng: random.Random | None = None
) -> float:
    """Delay before the attempt after `attempt_number` (1-based) failed."""
    policy = {**DEFAULT_RETRY, **policy}
    ceiling = min(
        float(policy["max_delay_seconds"]),
        float(policy["initial_delay_seconds"])
        * float(policy["backoff_factor"]) ** (attempt_number - 1),
    )
    if policy["jitter"]:
        # Full jitter (AWS architecture blog): spreads a burst of failures evenly.
        return (rng or random).uniform(0, ceiling)
    return ceiling


def retries_left(policy: dict, *, attempt_number: int) -> bool:
    return attempt_number < int({**DEFAULT_RETRY, **policy}["max_attempts"])


@dataclasses.dataclass(frozen=True)
class RetryDecision:
    retry_at: dt.datetime | None  # when the run's next attempt is due; None: the run fails
    failure_reason: str  # the run's failure_reason when it fails, else ""


# How an attempt that ran out of retries ended -> its run's failure_reason.
_EXHAUSTED_BY = {
    AttemptState.FAILED: FailureReason.EXHAUSTED,
    AttemptState.TIMED_OUT: FailureReason.TIMEOUT,
    AttemptState.LOST: FailureReason.LOST,
}


def retry_decision(
    *,
    spec: dict,
    attempt_number: int,
    retry_base: int,
    ended: str,
    retryable: bool = True,
    now: dt.datetime,
) -> RetryDecision:
    """Retry or fail, for a run whose attempt `attempt_number` ended without success: the one
    place that decides it, whoever ended the attempt (its worker, the reaper, reconciliation).

    `ended` is how the attempt ended (`AttemptState.FAILED`: the handler raised;
    `TIMED_OUT`; `LOST`: its lease expired); `retryable=False` for NonRetryableError.
    `retry_base` is the attempt count at the latest operator replay, which grants a fresh
    budget. With `delivery: at_most_once`, an attempt interrupted after it started (lost or
    timed out) has an unknown outcome and is never retried automatically.
    """
    if not retryable:
        return RetryDecision(None, FailureReason.ERROR)
    interrupted = ended in (AttemptState.LOST, AttemptState.TIMED_OUT)
    if spec.get("delivery") == "at_most_once" and interrupted:
        return RetryDecision(None, FailureReason.OUTCOME_UNKNOWN)
    budget_used = attempt_number - retry_base
    if retries_left(spec["retry"], attempt_number=budget_used):
        delay = retry_delay_seconds(spec["retry"], attempt_number=budget_used)
        return RetryDecision(now + dt.timedelta(seconds=delay), "")
    return RetryDecision(None, _EXHAUSTED_BY[ended])
