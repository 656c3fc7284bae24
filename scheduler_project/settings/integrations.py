"""Celery and Sentry: each key with its reason in docs/celery-settings.md."""

from kombu import Exchange, Queue

from jobs.lanes import lane_queues

from . import env

CELERY_BROKER_URL = env.CELERY_BROKER_URL
EMBEDDED_BROKER = CELERY_BROKER_URL.startswith("filesystem://")

# The queues jobs may name (SCHEDULER_QUEUES, docs/security.md: any other name answers
# 400, so no user creates broker queues); the first is the default, which the worker
# consumes unless told otherwise (-Q). The relay and the workers declare them all at start.
SCHEDULER_QUEUES = env.SCHEDULER_QUEUES
SCHEDULER_DEFAULT_QUEUE = SCHEDULER_QUEUES[0]
CELERY_TASK_DEFAULT_QUEUE = SCHEDULER_DEFAULT_QUEUE
# "quorum" on a RabbitMQ cluster; every queue, the default one and those jobs name, alike.
SCHEDULER_QUEUE_TYPE = env.SCHEDULER_QUEUE_TYPE
# Each configured queue with its lanes (jobs/lanes.py: `<queue>.backfill`, `.manual`, `.replay`).
CELERY_TASK_QUEUES = [
    Queue(
        name,
        Exchange(name, type="direct", durable=True),
        routing_key=name,
        durable=True,
        # Classic queues are declared without the argument, as Celery itself declares them.
        queue_arguments={"x-queue-type": "quorum"} if SCHEDULER_QUEUE_TYPE == "quorum" else None,
    )
    for name in lane_queues(SCHEDULER_QUEUES)
]
# The relay publishes to a queue only while its ready messages are under this mark.
SCHEDULER_QUEUE_HIGH_WATER = env.SCHEDULER_QUEUE_HIGH_WATER
# The relay publishes at most this many runs of one owner into the broker or running at
# once (None: unlimited), unless an operator set the owner's own (jobs.OwnerLimit).
SCHEDULER_OWNER_MAX_ACTIVE_RUNS = env.SCHEDULER_OWNER_MAX_ACTIVE_RUNS
CELERY_TASK_CREATE_MISSING_QUEUES = True
CELERY_TASK_CREATE_MISSING_QUEUE_TYPE = SCHEDULER_QUEUE_TYPE
# Celery's consumer without its native delayed delivery (broker-side countdowns on quorum
# queues): the product's delays wait in PostgreSQL, and that step's set-up against a dead
# node held a worker's consumption for about 18 s after a cluster node was lost.
CELERY_WORKER_CONSUMER = "scheduler_project.celery:Consumer"

# Early acknowledgement: a delivery is acked when a pool process takes it, and from then on
# the attempt's lease in PostgreSQL owns recovery (reaper), as does reconciliation for the
# short gap before the claim. No delivery stays unacked for the length of a run, so runs
# outlive RabbitMQ's consumer_timeout (docs/semantics.md, docs/celery-settings.md).
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# False: the claim and the fencing token already make a redelivered copy harmless, and
# cancelling would strand the attempt that is doing the work (docs/celery-settings.md).
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_DELIVERY_MODE = "persistent"
# Results are the runs' own (jobs.Run.result); Celery's copy only when asked for, as it
# costs a write per task: then django-celery-results keeps each task's state, name, args
# (the run ids) and worker, for AsyncResult, inspect, Flower and the admin.
CELERY_TASK_IGNORE_RESULT = not env.SCHEDULER_CELERY_RESULTS
CELERY_RESULT_BACKEND = "django-db" if env.SCHEDULER_CELERY_RESULTS else None
CELERY_RESULT_EXTENDED = env.SCHEDULER_CELERY_RESULTS
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
# A pool process keeps its database connection across tasks: Celery's Django fix-up closes
# it before and after every task unless this is set (a new connection per run cost more
# than the run). A connection broken meanwhile (PostgreSQL restarted) fails the next
# claim, which closes it and retries (dispatch.worker).
CELERY_DB_REUSE_MAX = 1_000_000
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_WORKER_SEND_TASK_EVENTS = False
CELERY_ENABLE_UTC = True

if EMBEDDED_BROKER:
    _broker_dir = env.VAR_DIR / "broker"
    for _folder in ("messages", "control", "processed"):
        (_broker_dir / _folder).mkdir(parents=True, exist_ok=True, mode=0o700)
    for _path in (_broker_dir, *_broker_dir.iterdir()):
        _path.chmod(0o700)  # its owner's only, as all of var/ (settings.base)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "messages"),
        "data_folder_out": str(_broker_dir / "messages"),
        "control_folder": str(_broker_dir / "control"),
        "processed_folder": str(_broker_dir / "processed"),
        "store_processed": False,
        # The default interval moves ~7 tasks/s; 50 ms moves hundreds (FIELD-NOTES).
        "polling_interval": 0.05,
    }
else:
    # The relay waits for confirms itself, per batch; Celery's own publishes (none in
    # the normal path) still wait for theirs.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}

SENTRY_DSN = env.SENTRY_DSN


def init_sentry() -> None:
    """Error reporting, on when SENTRY_DSN is set: unhandled exceptions of web requests
    (Django) and of Celery tasks, ERROR log records, and handlers' failures, which the
    worker reports itself (dispatch.worker) since they end as the attempt's outcome
    instead of escaping the task. No local variables and no personal data are sent: a
    job's args may hold secrets (docs/operations.md, "Error reporting")."""
    if not SENTRY_DSN:
        return
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.integrations.django import DjangoIntegration

    from jobs.redaction import redact_event

    sentry_sdk.init(
        dsn=SENTRY_DSN,
        integrations=[DjangoIntegration(), CeleryIntegration()],
        environment=env.SENTRY_ENVIRONMENT or None,
        send_default_pii=False,
        include_local_variables=False,
        # Secrets never leave: every event and breadcrumb through jobs.redaction, and no
        # request bodies (a job body's kwargs may hold them at any depth).
        before_send=redact_event,
        before_breadcrumb=redact_event,
        max_request_body_size="never",
        traces_sample_rate=env.SENTRY_TRACES_SAMPLE_RATE,
    )
