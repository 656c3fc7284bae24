"""All settings. test.py only overrides; nothing else reads the environment."""

import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote

from scheduler_project import embedded
from scheduler_project.embedded import EmbeddedPostgres

from . import env
from .database_url import database_url_parse
from .integrations import *  # noqa: F403
from .integrations import init_sentry

BASE_DIR = env.BASE_DIR
VAR_DIR = env.VAR_DIR
# var/ holds the secret key, the embedded PostgreSQL's data (token hashes, password
# hashes), run logs and the filesystem broker's messages: readable by their owner only
# (docs/security.md). Folders 0700, files 0600: those made here explicitly, the rest (the
# broker's, the logs') through a umask that this process keeps while it writes there;
# PostgreSQL keeps its own files 0600 in its 0700 folder. Run as root, the embedded
# server's user may search var/ (0710, scheduler_project.embedded), not read it.
PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600
if env.USES_VAR_DIR:
    os.umask(0o077)
VAR_DIR.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
# Also an older installation's, made before this rule; the search right stays only for
# another group than this process's (the embedded server's user, given it as root).
_var = VAR_DIR.stat()
VAR_DIR.chmod(PRIVATE_DIR_MODE | (_var.st_mode & 0o010 if _var.st_gid != os.getegid() else 0))


def _secret_key() -> str:
    if env.DJANGO_SECRET_KEY:
        return env.DJANGO_SECRET_KEY
    # Embedded defaults: one random key per installation, kept beside the database.
    # Processes started together race to make it: each writes a whole key aside and links
    # it into place (atomic; the first link wins), so none reads a half-written or empty
    # key, and none fails because another made it first.
    path = VAR_DIR / "secret_key"
    if not path.exists():
        aside = VAR_DIR / f".secret_key.{os.getpid()}"
        descriptor = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_urlsafe(50))
                file.flush()
                os.fsync(file.fileno())
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
        finally:
            aside.unlink(missing_ok=True)
    path.chmod(PRIVATE_FILE_MODE)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env.DJANGO_DEBUG
ALLOWED_HOSTS = env.DJANGO_ALLOWED_HOSTS
CSRF_TRUSTED_ORIGINS = env.DJANGO_CSRF_TRUSTED_ORIGINS
if env.DJANGO_SECURE:
    # Behind a TLS-terminating proxy that sets X-Forwarded-Proto (docs/security.md).
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    # Probes and scrapers inside the cluster may speak plain HTTP to a pod.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = 31_536_000  # a year
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True  # the header only: submitting the domain is the deployer's

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, pinned, served as our static files
    "django_celery_results",  # its tables always; used as the backend when switched on
    "jobs",
    "dispatch",
    "logs_app",
]

MIDDLEWARE = [
    "scheduler_project.middleware.BodySizeLimitMiddleware",
    "scheduler_project.middleware.DatabaseUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "scheduler_project.urls"
WSGI_APPLICATION = "scheduler_project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def embedded_database(data_dir: Path) -> dict:
    """The embedded PostgreSQL whose data is in `data_dir`, over its Unix socket; its
    backend starts it when a connection finds it stopped (scheduler_project.embedded)."""
    server = EmbeddedPostgres(data_dir)
    return _database(
        f"postgres://{embedded.SUPERUSER}@{quote(str(server.socket_dir), safe='')}"
        f":{embedded.PORT}/{embedded.DATABASE}",
        ENGINE="scheduler_project.embedded",
        EMBEDDED_DATA_DIR=str(data_dir),
    )


def _database(url: str, **overrides) -> dict:
    config = database_url_parse(url, conn_max_age=60, conn_health_checks=True) | overrides
    if config["ENGINE"].startswith(("django.db.backends.postgresql", "scheduler_project")):
        config["OPTIONS"] = {
            # A peer that vanished (a partitioned or frozen worker) is found within about
            # a minute, and a session left idle inside a transaction (a handler frozen in a
            # `ctx.effect` block) is ended after 10 minutes, releasing the run row it locks.
            "keepalives": 1,
            "keepalives_idle": 30,
            "keepalives_interval": 10,
            "keepalives_count": 3,
            "options": "-c idle_in_transaction_session_timeout=600000",
            # psycopg may prepare statements (Django disables it by default for poolers in
            # transaction mode; none is used). Only the hot statements ask for it
            # (storage.sql.prepared_cursor); Django's own cursors bind on the client and
            # are never prepared. `?prepare_threshold=none` in DATABASE_URL turns it off.
            "prepare_threshold": 5,
            **config.get("OPTIONS", {}),
        }
        threshold = config["OPTIONS"]["prepare_threshold"]
        if isinstance(threshold, str):  # from the URL's query: psycopg wants an int or None
            none = threshold.strip().lower() in ("none", "")
            config["OPTIONS"]["prepare_threshold"] = None if none else int(threshold)
        if env.SCHEDULER_DB_APPLICATION_NAME:
            config["OPTIONS"]["application_name"] = env.SCHEDULER_DB_APPLICATION_NAME
    return config


DATABASES = {
    "default": _database(env.DATABASE_URL)
    if env.DATABASE_URL
    else embedded_database(VAR_DIR / "postgres")
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
SCHEDULER_SERVE_STATIC = env.SCHEDULER_SERVE_STATIC
STATIC_ROOT = VAR_DIR / "static"

# Run logs' content (logs_app): the filesystem under var/logs unless configured otherwise.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "scheduler_logs": {
        "BACKEND": env.SCHEDULER_LOG_STORAGE,
        "OPTIONS": json.loads(env.SCHEDULER_LOG_STORAGE_OPTIONS)
        if env.SCHEDULER_LOG_STORAGE_OPTIONS
        else {
            "location": str(VAR_DIR / "logs"),
            "file_permissions_mode": PRIVATE_FILE_MODE,
            "directory_permissions_mode": PRIVATE_DIR_MODE,
        }
        if env.SCHEDULER_LOG_STORAGE.endswith("FileSystemStorage")
        else {},
    },
}
SCHEDULER_LOGS = {
    "capture": env.SCHEDULER_LOG_CAPTURE,
    "inline_max_bytes": 16 * 1024,  # chunks up to this size stay in their PostgreSQL row
    "max_bytes_per_attempt": env.SCHEDULER_LOG_MAX_BYTES,
    "retention_days": env.SCHEDULER_LOG_RETENTION_DAYS,
    "flush_interval_seconds": 1.0,  # a live tail lags by at most about this
    "flush_lines": 1000,
    "flush_bytes": 256 * 1024,
    "buffer_max_bytes": 16 * 1024 * 1024,  # held while the log store is unreachable
}
# Finished runs and everything that hangs off them go this long after they finished.
SCHEDULER_RUN_RETENTION_DAYS = env.SCHEDULER_RUN_RETENTION_DAYS
LOGIN_URL = "/admin/login/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "jobs.tokens.TokenAuthentication",  # hashed at rest, expiring, revocable
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["jobs.api.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "jobs.api.base.api_exception_handler",
    # Counted in the database every web process shares (jobs.throttling), per user.
    "DEFAULT_THROTTLE_CLASSES": ["jobs.throttling.UserThrottle", "jobs.throttling.ScopedThrottle"],
    "DEFAULT_THROTTLE_RATES": {
        "user": "6000/min",
        "bulk": "60/min",  # up to 1,000 jobs each
        "backfill": "60/min",
        "logs_follow": "240/min",  # long polls of up to 25 s
        "admin_login": "10/min",  # per client address
        **env.SCHEDULER_THROTTLE_RATES,
    },
    "NUM_PROXIES": env.SCHEDULER_NUM_PROXIES,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Durable job scheduler API",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema and its docs page authenticate, as every endpoint does (docs/security.md).
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # Swagger UI from the pinned drf-spectacular-sidecar package, on our origin: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
        },
    },
    "filters": {"redact": {"()": "jobs.redaction.RedactingFilter"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": env.SCHEDULER_LOG_FORMAT,
            "filters": ["redact"],
        }
    },
    "root": {"handlers": ["console"], "level": "INFO"},
    # httpx logs every webhook post at INFO; the deliveries' attempts record them instead.
    "loggers": {"httpx": {"level": "WARNING"}},
}

SCHEDULER_TASK_MODULES = env.SCHEDULER_TASK_MODULES
# Lifetime of a new API token (0: no expiry).
SCHEDULER_TOKEN_TTL_DAYS = env.SCHEDULER_TOKEN_TTL_DAYS
SCHEDULER_METRICS_TOKEN = env.SCHEDULER_METRICS_TOKEN
# Bounds on waiting live tails, so that they never hold every web worker (logs_app.tails).
SCHEDULER_LOG_FOLLOW_MAX_WAITING = env.SCHEDULER_LOG_FOLLOW_MAX_WAITING
SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER = env.SCHEDULER_LOG_FOLLOW_MAX_WAITING_PER_USER
SCHEDULER_LOG_FOLLOW_SLOTS_DIR = env.SCHEDULER_LOG_FOLLOW_SLOTS_DIR
# Size bound of a job's args, and of its kwargs, each serialized as JSON; and of the whole
# job body (every PATCH copies it into a new version).
SCHEDULER_MAX_PAYLOAD_BYTES = 64 * 1024
SCHEDULER_MAX_SPEC_BYTES = 128 * 1024  # less than args and kwargs at their limits
SCHEDULER_OWNER_MAX_JOBS = env.SCHEDULER_OWNER_MAX_JOBS
# Webhooks (jobs.webhooks, dispatch.webhooks).
SCHEDULER_WEBHOOK_ALLOW_PRIVATE = env.SCHEDULER_WEBHOOK_ALLOW_PRIVATE
SCHEDULER_WEBHOOK_RETRY_SECONDS = env.SCHEDULER_WEBHOOK_RETRY_SECONDS
# A fan-in's wait when its spec has no `within_seconds` (jobs.dependencies).
SCHEDULER_DEPENDENCY_WITHIN_SECONDS = env.SCHEDULER_DEPENDENCY_WITHIN_SECONDS
# Partitions of due work between scheduler replicas, and their leases (dispatch.partitions).
SCHEDULER_PARTITIONS = env.SCHEDULER_PARTITIONS
SCHEDULER_PARTITION_LEASE_SECONDS = env.SCHEDULER_PARTITION_LEASE_SECONDS

init_sentry()
