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
