"""The Celery app. Workers: `celery -A scheduler_project worker`."""

import logging
import os

from celery import Celery
from celery.signals import worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings.base")

app = Celery("scheduler_project")
app.config_from_object("django.conf:settings", namespace="CELERY")


@worker_ready.connect
def declare_allowed_queues(sender, **kwargs) -> None:
    """Every queue of SCHEDULER_QUEUES, declared when a worker starts (it consumes those
    of -Q); a queue the broker refuses is logged, the worker goes on."""
    from django.conf import settings

    with sender.app.connection_for_write() as connection:
        for name in settings.SCHEDULER_QUEUES:
            try:
                sender.app.amqp.queues[name](connection.default_channel).declare()
            except Exception as exc:  # noqa: BLE001 - reported; the consumer reports its own
                logging.getLogger("dispatch").error("queue %r not declared: %s", name, exc)
                connection.close()


@worker_ready.connect
def measure_clock_skew(sender, **kwargs) -> None:
    """The worker's skew against the database's clock, measured by its main process while
    it lives (its pool processes share its host's clock)."""
    from dispatch.clockskew import ClockSkewConfig, clock_skew_thread
    from dispatch.loop import StopSignal

    clock_skew_thread(ClockSkewConfig(kind="worker", name=sender.hostname), StopSignal()).start()


# Client task modules (SCHEDULER_TASK_MODULES) are imported by dispatch's AppConfig.ready,
# which Celery's Django fix-up runs in every worker before it consumes.
