"""Scheduler loop, outbox relay, worker runtime. Client code imports `job_task` from here."""

from .registry import job_task

__all__ = ["job_task"]
