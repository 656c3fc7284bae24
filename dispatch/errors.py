"""Exceptions a handler may raise or meet; importable before Django's apps are ready."""

from jobs.errors import StaleAttempt

__all__ = ["NonRetryableError", "StaleAttempt"]


class NonRetryableError(Exception):
    """Raised by a handler for a failure that another attempt cannot fix (bad input, a
    permanent refusal): the run fails at once with `failure_reason: error`, no retry."""
