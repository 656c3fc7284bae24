"""The one place that reads the environment (the documented names)."""

import math
import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent.parent
# Embedded defaults keep their files here (the embedded PostgreSQL's data, the filesystem
# broker), with the secret key and run logs.
VAR_DIR = Path(os.environ.get("SCHEDULER_VAR_DIR", BASE_DIR / "var")).resolve()


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in {"1", "true", "yes", "on"}


def env_number(name: str, default: float, *, minimum: float, maximum: float, kind=float):
    """A number from the environment; ValueError naming the variable and the reason."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                         f"not {raw!r}") from None  # fmt: skip
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be between {minimum} and {maximum}, not {raw!r}")
    return value


def env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def env_days(name: str, default: str) -> float:
    """A positive number of days; fractions allowed (a test's retention of a few seconds)."""
    raw = env_str(name, default)
    try:
        days = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of days, not {raw!r}") from None
    if not math.isfinite(days) or days <= 0:
        raise ValueError(f"{name} must be a number of days greater than 0, not {raw!r}")
    return days


# Empty: the embedded PostgreSQL in var/postgres (scheduler_project.embedded).
DATABASE_URL = env_str("DATABASE_URL", "")
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://")
# On embedded defaults (a database or a broker under var/), every file the process
# writes is its owner's only (settings.base).
USES_VAR_DIR = not DATABASE_URL or CELERY_BROKER_URL.startswith("filesystem")
DJANGO_SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "")
DJANGO_DEBUG = env_bool("DJANGO_DEBUG", False)
DJANGO_ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS") or ["localhost", "127.0.0.1", "[::1]"]
SENTRY_DSN = os.environ.get("SENTRY_DSN", "")
# Production behind TLS: secure cookies, HSTS, HTTPS redirects, the proxy's SSL header.
DJANGO_SECURE = env_bool("DJANGO_SECURE", False)
# Origins allowed to POST with the session (the admin behind another host name), e.g.
# https://scheduler.example.com.
DJANGO_CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS")
# PostgreSQL's application_name of this process's connections (standalone names its children).
SCHEDULER_DB_APPLICATION_NAME = os.environ.get("SCHEDULER_DB_APPLICATION_NAME", "")
# The web server serves /static/ itself (set by `standalone`, which has no other server).
SCHEDULER_SERVE_STATIC = env_bool("SCHEDULER_SERVE_STATIC", False)
SCHEDULER_TASK_MODULES = env_list("SCHEDULER_TASK_MODULES")
# The only queues a job may name (comma-separated); the first is a job's default.
SCHEDULER_QUEUES = env_list("SCHEDULER_QUEUES") or ["jobs"]
SCHEDULER_QUEUE_TYPE = env_str("SCHEDULER_QUEUE_TYPE", "classic")
if SCHEDULER_QUEUE_TYPE not in {"classic", "quorum"}:
    raise ValueError(
        f"SCHEDULER_QUEUE_TYPE must be classic or quorum, not {SCHEDULER_QUEUE_TYPE!r}"
    )


def env_positive_int(name: str, default: int) -> int:
    text = env_str(name, str(default))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {text!r}")
    return value


# Backpressure: the relay keeps each queue's ready messages under this mark (docs/semantics.md).
SCHEDULER_QUEUE_HIGH_WATER = env_positive_int("SCHEDULER_QUEUE_HIGH_WATER", 10_000)
# Fair shares: at most this many runs of one owner in the broker or running at once
# (empty: unlimited); an operator's per-owner limit (jobs.OwnerLimit) overrides it.
SCHEDULER_OWNER_MAX_ACTIVE_RUNS = (
    env_positive_int("SCHEDULER_OWNER_MAX_ACTIVE_RUNS", 1)
    if env_str("SCHEDULER_OWNER_MAX_ACTIVE_RUNS", "")
    else None
)

# Run logs: where their content goes (any Django storage backend: a dotted class path, and
# its options as JSON), how long they are kept, and how much one attempt may write.
SCHEDULER_LOG_STORAGE = env_str(
    "SCHEDULER_LOG_STORAGE", "django.core.files.storage.FileSystemStorage"
)
SCHEDULER_LOG_STORAGE_OPTIONS = os.environ.get("SCHEDULER_LOG_STORAGE_OPTIONS", "")
SCHEDULER_LOG_RETENTION_DAYS = int(env_str("SCHEDULER_LOG_RETENTION_DAYS", "30"))
# Finished runs (with their attempts, outbox rows, effects, audit events and logs) are
# pruned this long after they finished (dispatch.pruner; docs/operations.md, "Retention").
SCHEDULER_RUN_RETENTION_DAYS = env_days("SCHEDULER_RUN_RETENTION_DAYS", "30")
# false: handlers' output is not captured (it goes to the worker's own log, as Celery does).
SCHEDULER_LOG_CAPTURE = env_bool("SCHEDULER_LOG_CAPTURE", True)
SCHEDULER_LOG_MAX_BYTES = int(env_str("SCHEDULER_LOG_MAX_BYTES", str(10 * 1024 * 1024)))
# The bearer token a Prometheus scraper sends to /metrics (empty: operators' tokens only).
SCHEDULER_METRICS_TOKEN = os.environ.get("SCHEDULER_METRICS_TOKEN", "")
# The most active and paused jobs one owner may hold (429 beyond it).
SCHEDULER_OWNER_MAX_JOBS = int(env_str("SCHEDULER_OWNER_MAX_JOBS", "100000"))
# A fan-in (a job after several jobs) without its own `within_seconds` waits at most this
# long after its first upstream arrived for the others, then records the occurrence
# `skipped` (`upstream: ...`): every gate is decided within a bound.
SCHEDULER_DEPENDENCY_WITHIN_SECONDS = env_number(
    "SCHEDULER_DEPENDENCY_WITHIN_SECONDS", 86400, minimum=1, maximum=366 * 86400
)
# Webhooks may target loopback, private and link-local addresses (tests, one machine).
SCHEDULER_WEBHOOK_ALLOW_PRIVATE = env_bool("SCHEDULER_WEBHOOK_ALLOW_PRIVATE", False)
# The first retry of a webhook delivery waits this long; each next one twice as long.
SCHEDULER_WEBHOOK_RETRY_SECONDS = env_number(
    "SCHEDULER_WEBHOOK_RETRY_SECONDS", 10, minimum=0.01, maximum=3600
)
# Throttle rates by scope, overriding the defaults: "user=6000/min,bulk=60/min".
SCHEDULER_THROTTLE_RATES = dict(
    item.split("=", 1) for item in env_list("SCHEDULER_THROTTLE_RATES") if "=" in item
)
# Proxies in front of the web tier that append to X-Forwarded-For (0: the client address
# is the connection's, and a client cannot choose its own throttle key).
SCHEDULER_NUM_PROXIES = int(env_str("SCHEDULER_NUM_PROXIES", "0"))
# Lifetime of a new API token in days (0: tokens never expire).
SCHEDULER_TOKEN_TTL_DAYS = int(env_str("SCHEDULER_TOKEN_TTL_DAYS", "90"))
# Live log tails waiting at once (long polls) on this host, and of one user (logs_app.tails).
SCHEDULER_LOG_FOLLOW_MAX_WAITING = int(env_str("SCHEDULER_LOG_FOLLOW_MAX_WAITING", "2"))
SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER = int(
    env_str("SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER", "2")
)
SCHEDULER_LOG_FOLLOW_SLOTS_DIR = env_str(
    "SCHEDULER_LOG_FOLLOW_SLOTS_DIR", str(VAR_DIR / "log-follow")
)
# plain: "time level logger message" lines; json: one JSON object per line (for a log
# shipper), with the record's extra fields (a run's logger adds run_id and attempt).
SCHEDULER_LOG_FORMAT = env_str("SCHEDULER_LOG_FORMAT", "plain")
if SCHEDULER_LOG_FORMAT not in {"plain", "json"}:
    raise ValueError(f"SCHEDULER_LOG_FORMAT must be plain or json, not {SCHEDULER_LOG_FORMAT!r}")
# true: Celery's result backend is the database (django-celery-results), so AsyncResult,
# `celery inspect`, Flower and the admin's task results show each delivery's task. Off by
# default: it costs a write per task (docs/operations.md, "Celery's own tools").
SCHEDULER_CELERY_RESULTS = env_bool("SCHEDULER_CELERY_RESULTS", False)
# Scheduler replicas share due work by partition, each holding leases on its share
# (dispatch.partitions): how many partitions (the same on every replica), and how long a
# lease lasts unrenewed (a dead replica's partitions move within it).
SCHEDULER_PARTITIONS = env_number("SCHEDULER_PARTITIONS", 64, minimum=1, maximum=4096, kind=int)
SCHEDULER_PARTITION_LEASE_SECONDS = env_number(
    "SCHEDULER_PARTITION_LEASE_SECONDS", 10.0, minimum=1.0, maximum=600.0
)
# Sentry's performance tracing: the share of requests and tasks traced (0: errors only).
SENTRY_TRACES_SAMPLE_RATE = float(env_str("SENTRY_TRACES_SAMPLE_RATE", "0"))
SENTRY_ENVIRONMENT = os.environ.get("SENTRY_ENVIRONMENT", "")
