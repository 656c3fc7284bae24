"""Scheduler loop, outbox relay, worker runtime. Client code imports `job_task` from here."""

from .errors import NonRetryableError, StaleAttempt
from .registry import job_task

__all__ = ["NonRetryableError", "StaleAttempt", "job_task"]
