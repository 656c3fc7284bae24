"""A Python client of the scheduler's REST API, without Django (httpx), and `schedctl`,
the command line built on it (scheduler_client.cli)."""

from .client import ApiError, Client, ConnectionFailed
from .models import (
    Attempt,
    BackfillResult,
    Job,
    LogLine,
    LogPage,
    Occurrence,
    Operation,
    Run,
)

__all__ = [
    "ApiError",
    "Attempt",
    "BackfillResult",
    "Client",
    "ConnectionFailed",
    "Job",
    "LogLine",
    "LogPage",
    "Occurrence",
    "Operation",
    "Run",
]
