"""The Celery app. Workers: `celery -A scheduler_project worker`."""

import os

import celery.app.trace
from celery import Celery
from celery.signals import celeryd_after_setup, worker_ready
from celery.worker.consumer import Consumer as CeleryConsumer

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings.base")

app = Celery("scheduler_project")
# Celery logs every task that returned as "succeeded"; a job task returns after recording
# its run's outcome, failed or not (dispatch.worker logs a failure with its traceback), so
# the line says what is true: the message was handled, and the run's outcome.
celery.app.trace.LOG_SUCCESS = "Task %(name)s[%(id)s] handled in %(runtime)ss: %(return_value)s"
app.config_from_object("django.conf:settings", namespace="CELERY")

DELAYED_DELIVERY_STEP = "celery.worker.consumer.delayed_delivery:DelayedDelivery"


class Consumer(CeleryConsumer):
    """Celery's consumer without its native delayed delivery step (CELERY_WORKER_CONSUMER).

    Celery turns that step on whenever it sees quorum queues: at every (re)connection it
    declares and binds its delayed-delivery exchanges and queues, retrying against a node
    that just died for some 18 s before the worker consumes again. The product never asks
    the broker for a delay (countdowns and retries wait in PostgreSQL), so the step buys
    nothing, and without it a worker consumes again as soon as it reaches another node."""

    class Blueprint(CeleryConsumer.Blueprint):
        default_steps = [
            step for step in CeleryConsumer.Blueprint.default_steps if step != DELAYED_DELIVERY_STEP
        ]


@celeryd_after_setup.connect
def consume_lanes(sender, instance, **kwargs) -> None:
    """A worker that consumes a configured queue (`-Q jobs`, or every queue without -Q)
    consumes its lanes too (`jobs.backfill`, `jobs.manual`, `jobs.replay`: jobs/lanes.py),
    so no command line has to name them; a worker given only a lane (`-Q jobs.backfill`)
    keeps to it."""
    from django.conf import settings

    from jobs.lanes import lanes_of

    queues = instance.app.amqp.queues
    for name in list(queues.consume_from):
        if name in settings.SCHEDULER_QUEUES:
            for lane in lanes_of(name):
                queues.select_add(queues[lane])


@worker_ready.connect
def declare_allowed_queues(sender, **kwargs) -> None:
    """Every queue of SCHEDULER_QUEUES and their lanes, declared when a worker starts (it
    consumes those of -Q) as a relay declares them; a queue the broker refuses is logged,
    the worker goes on."""
    from django.conf import settings

    from dispatch.broker import ConfirmingPublisher, queues_declare
    from jobs.lanes import lane_queues

    broker = ConfirmingPublisher(
        settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    try:
        queues_declare(broker, lane_queues(settings.SCHEDULER_QUEUES))
    finally:
        broker.close()


@worker_ready.connect
def measure_clock_skew(sender, **kwargs) -> None:
    """The worker's skew against the database's clock, measured by its main process while
    it lives (its pool processes share its host's clock)."""
    from dispatch.clockskew import ClockSkewConfig, clock_skew_thread
    from dispatch.loop import StopSignal

    clock_skew_thread(ClockSkewConfig(kind="worker", name=sender.hostname), StopSignal()).start()


# Client task modules (SCHEDULER_TASK_MODULES) are imported by dispatch's AppConfig.ready,
# which Celery's Django fix-up runs in every worker before it consumes.
