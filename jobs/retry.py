"""Retry policy: exponential backoff with a cap and optional full jitter."""

import random

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


# Why an attempt ended without success.
CAUSE_ERROR = "error"  # the handler raised
CAUSE_NON_RETRYABLE = "non_retryable"  # the handler raised NonRetryableError
CAUSE_TIMEOUT = "timeout"  # it ran past timeout_seconds
CAUSE_LOST = "lost"  # its lease expired: the worker vanished


def failure_outcome(
    spec: dict, *, attempt_number: int, retry_base: int, cause: str
) -> tuple[float | None, str]:
    """(seconds until the retry, "") when the run retries, else (None, failure_reason).

    `retry_base` is the attempt count at the latest operator replay, which grants a fresh
    budget. With `delivery: at_most_once`, an attempt interrupted after it started (lost or
    timed out) has an unknown outcome and is never retried automatically.
    """
    if cause == CAUSE_NON_RETRYABLE:
        return None, "error"
    if spec.get("delivery") == "at_most_once" and cause in (CAUSE_LOST, CAUSE_TIMEOUT):
        return None, "outcome_unknown"
    budget_used = attempt_number - retry_base
    if retries_left(spec["retry"], attempt_number=budget_used):
        return retry_delay_seconds(spec["retry"], attempt_number=budget_used), ""
    return None, {CAUSE_ERROR: "exhausted", CAUSE_TIMEOUT: "timeout", CAUSE_LOST: "lost"}[cause]
